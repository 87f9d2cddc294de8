"""Accuracy of fp8 weights (`quantization="fp8"`) on SmolLM2-135M, the embedded real weights, on
the CPU in float32: perplexity of English text nobody here wrote (the Python documentation that
ships with the standard library, ``pydoc_data.topics.topics``, topics in sorted order) with the
float32 weights and with fp8 weights (float32 compute; ``--bf16``: also bfloat16 weights and
compute), and greedy agreement with float32 on ``--prompts`` prompts (pieces of the same text) x
``--max-tokens`` tokens: per prompt, the fraction of positions equal up to the first divergence,
averaged. Perplexity: the text's first ``--tokens`` tokens in windows of
``--window`` tokens, each scored from its own start (`SamplingParams.prompt_logprobs`). Prints a
table and appends one JSON line to ``benchmarks/weights_accuracy.jsonl``.

    python scripts/eval_weights_accuracy.py [--tokens 4096] [--window 512]
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from scripts.run_info import git_commit  # noqa: E402


def english_text() -> str:
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics))


def perplexity(llm, windows: list[list[int]]) -> float:
    """exp(mean NLL) of every window's tokens after its first, each window scored alone."""
    from jaxinfer import SamplingParams

    outs = llm.generate([{"prompt_token_ids": w} for w in windows],
                        SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0))
    nll = [-lp[t].logprob for o, w in zip(outs, windows)
           for lp, t in zip(o.prompt_logprobs[1:], w[1:])]
    return math.exp(sum(nll) / len(nll))


def greedy(llm, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    from jaxinfer import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in llm.generate(
        [{"prompt_token_ids": p} for p in prompts], sp)]


def agreement(a: list[int], b: list[int]) -> float:
    """Fraction of positions equal up to the first divergence."""
    n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
    return n / len(a)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=4096, help="tokens of text for perplexity")
    p.add_argument("--window", type=int, default=512, help="tokens per scored window")
    p.add_argument("--prompts", type=int, default=20)
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--bf16", action="store_true", help="also bfloat16 weights and compute, for "
                   "scale: how far mere bf16 rounding moves the same numbers")
    p.add_argument("--out", default=os.path.join("benchmarks", "weights_accuracy.jsonl"))
    args = p.parse_args()

    from jaxinfer import LLM

    kw = dict(dtype="float32", max_model_len=max(args.window + 1, args.prompt_tokens +
                                                 args.max_tokens), max_num_seqs=args.prompts)
    llms = {"float32": LLM(**kw)}
    ids = llms["float32"].encode(english_text(), add_special_tokens=False)
    if len(ids) < args.tokens + args.prompts * args.prompt_tokens * 8:
        raise SystemExit(f"the text has only {len(ids)} tokens")
    windows = [ids[i:i + args.window] for i in range(0, args.tokens, args.window)]
    stride = (len(ids) - args.tokens) // args.prompts                  # prompts after that text
    prompts = [ids[args.tokens + i * stride:][:args.prompt_tokens] for i in range(args.prompts)]
    if args.bf16:
        llms["bfloat16"] = LLM(**dict(kw, dtype="bfloat16"))
    llms["fp8"] = LLM(quantization="fp8", **kw)
    rows, base = [], None
    for name, llm in llms.items():
        t0 = time.perf_counter()
        ppl, toks = perplexity(llm, windows), greedy(llm, prompts, args.max_tokens)
        base = base or (ppl, toks)
        agree = sum(agreement(a, b) for a, b in zip(toks, base[1])) / len(toks)
        rows.append(dict(bench="weights_accuracy", weights=name, perplexity=round(ppl, 4),
                         ppl_vs_float32=round(ppl / base[0] - 1, 5), greedy_agreement=round(
                             agree, 4), tokens=len(windows) * args.window, window=args.window,
                         prompts=args.prompts, max_tokens=args.max_tokens,
                         seconds=round(time.perf_counter() - t0, 1)))
    print(f"{'weights':<8} {'perplexity':>10} {'vs f32':>8} {'greedy agreement':>17}")
    for r in rows:
        print(f"{r['weights']:<8} {r['perplexity']:>10.4f} {r['ppl_vs_float32']:>+8.2%} "
              f"{r['greedy_agreement']:>17.3f}")
    meta = dict(model="SmolLM2-135M-Instruct (embedded GGUF)", text="pydoc_data.topics",
                commit=git_commit(), date=datetime.date.today().isoformat())
    with open(args.out, "a") as f:
        for r in rows:
            f.write(json.dumps(dict(r, **meta)) + "\n")


if __name__ == "__main__":
    main()
