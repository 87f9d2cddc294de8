"""CPU benchmark: jaxinfer vs HF transformers eager on the same SmolLM2-135M weights, greedy.

Both engines run the same prompts with ``ignore_eos`` (HF: ``min_new_tokens``) so every request
generates exactly ``--max-tokens`` tokens; compilation/warm-up is excluded (each engine runs the
workload once before timing). Prints a table and appends one JSON object per configuration to
``benchmarks/cpu.jsonl``.

    python scripts/bench_cpu.py [--batches 1 16] [--max-tokens 32]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from scripts.run_info import git_commit  # noqa: E402

PROMPTS = [
    "The history of the printing press",
    "Write a short poem about the sea.",
    "Explain what a hash table is in one paragraph.",
    "List three uses of copper:",
    "Once upon a time in a small village,",
    "The quick brown fox",
    "What is the boiling point of water at sea level?",
    "Translate 'good morning' into French:",
]


def prompts_for(batch: int) -> list[str]:
    return [PROMPTS[i % len(PROMPTS)] + (" Please." * (i // len(PROMPTS))) for i in range(batch)]


def bench_jaxinfer(llm, prompts, max_tokens) -> tuple[float, int]:
    from jaxinfer import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate(prompts, sp)  # warm-up: compiles every bucket this workload uses
    t = time.perf_counter()
    outs = llm.generate(prompts, sp)
    dt = time.perf_counter() - t
    return dt, sum(len(o.token_ids) for o in outs)


def bench_hf(model, tok, prompts, max_tokens) -> tuple[float, int]:
    import torch

    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    enc = tok(prompts, return_tensors="pt", padding=True)
    kw = dict(
        max_new_tokens=max_tokens,
        min_new_tokens=max_tokens,
        do_sample=False,
        pad_token_id=tok.pad_token_id,
    )
    with torch.inference_mode():
        model.generate(**enc, **kw)
        t = time.perf_counter()
        out = model.generate(**enc, **kw)
        dt = time.perf_counter() - t
    return dt, int((out.shape[1] - enc["input_ids"].shape[1]) * out.shape[0])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument(
        "--dtype",
        choices=["float32", "bfloat16"],
        default="float32",
        help="compute dtype of BOTH engines (same weights, dequantised to it)",
    )
    ap.add_argument("--out", default="benchmarks/cpu.jsonl")
    args = ap.parse_args()

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from checkpoints_tools.default_model import default_model_path
    from jaxinfer import LLM

    path = default_model_path()
    d, f = os.path.split(path)
    tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
    hf = AutoModelForCausalLM.from_pretrained(
        d, gguf_file=f, dtype=getattr(torch, args.dtype)
    ).eval()
    llm = LLM(path, max_num_seqs=max(args.batches), max_model_len=1024, dtype=args.dtype)

    commit = git_commit()
    rows = []
    for b in args.batches:
        prompts = prompts_for(b)
        jt, jn = bench_jaxinfer(llm, prompts, args.max_tokens)
        ht, hn = bench_hf(hf, tok, prompts, args.max_tokens)
        rows.append(
            dict(
                bench="cpu_generate",
                batch=b,
                max_tokens=args.max_tokens,
                dtype=args.dtype,
                jaxinfer_tok_s=jn / jt,
                hf_tok_s=hn / ht,
                ratio=(jn / jt) / (hn / ht),
                torch_threads=torch.get_num_threads(),
                cpu=platform.processor() or platform.machine(),
                date=datetime.date.today().isoformat(),
                commit=commit,
            )
        )
    print(f"dtype {args.dtype}, {args.max_tokens} new tokens per request, greedy, ignore_eos")
    print(f"{'batch':>5} {'jaxinfer tok/s':>15} {'HF tok/s':>10} {'ratio':>7}")
    for r in rows:
        print(
            f"{r['batch']:>5} {r['jaxinfer_tok_s']:>15.1f} {r['hf_tok_s']:>10.1f} "
            f"{r['ratio']:>7.2f}x"
        )
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "a") as fh:
        for r in rows:
            fh.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
