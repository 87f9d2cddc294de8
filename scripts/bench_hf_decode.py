"""HF transformers' decode step time, the baseline of `bench_engine_decode.py`: B rows of a
``--context``-token random prompt through ``model.generate`` (greedy, a static KV cache) on a
random-weight bf16 model of ``--model``'s architecture (`scripts.plan_memory.PRESETS`: qwen3-8b,
qwen3-30b-a3b; ``--layers`` fewer layers), on the GPU. Per step: the time of ``--steps`` + 8
new tokens minus that of 8, over ``--steps`` (prefill and the first steps cancel). ``--compile``
wraps the forward in ``torch.compile(mode="reduce-overhead", fullgraph=True)`` (HF's static-cache
recipe); a model that cannot compile is reported as such, and ``--compile`` is then dropped
(eager). Prints a table and appends one JSON line per batch size (bench="hf_decode").

    python scripts/bench_hf_decode.py [--model qwen3-30b-a3b] [--batches 1,64] [--context 1024]
        [--steps 32] [--layers L] [--compile] [--out benchmarks/engine_decode.jsonl]
"""

import argparse
import dataclasses
import datetime
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def hf_config(cfg):
    """The HF ``Qwen3Config`` / ``Qwen3MoeConfig`` of a `ModelConfig` (qwen3, qwen3_moe)."""
    import transformers

    common = dict(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        rope_theta=cfg.rope_theta,
        rms_norm_eps=cfg.rms_norm_eps,
        max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=cfg.tie_word_embeddings,
    )
    if cfg.architecture == "qwen3":
        return transformers.Qwen3Config(**common)
    return transformers.Qwen3MoeConfig(
        **common,
        num_experts=cfg.num_experts,
        num_experts_per_tok=cfg.num_experts_per_tok,
        moe_intermediate_size=cfg.moe_intermediate_size,
        norm_topk_prob=cfg.norm_topk_prob,
        decoder_sparse_step=cfg.decoder_sparse_step,
        mlp_only_layers=list(cfg.mlp_only_layers),
    )


def random_model(config, device: str):
    """A random bf16 ``AutoModelForCausalLM`` of ``config`` built on ``device`` (N(0, 0.02))."""
    import torch
    import transformers

    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    return model.eval()


def generate_seconds(model, prompts, new_tokens: int) -> float:
    """Wall seconds of one greedy ``generate`` of exactly ``new_tokens`` tokens a row."""
    import torch

    if prompts.is_cuda:
        torch.cuda.synchronize()
    t = time.perf_counter()
    with torch.no_grad():
        model.generate(
            prompts,
            attention_mask=torch.ones_like(prompts),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            cache_implementation="static",
        )
    if prompts.is_cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - t


def step_ms(model, batch: int, context: int, steps: int, device: str) -> float:
    """Mean ms of one decode step at ``batch`` rows after a ``context``-token prompt."""
    import torch

    gen = torch.Generator().manual_seed(0)
    hi = min(model.config.vocab_size, 50000)
    prompts = torch.randint(hi // 2, hi, (batch, context - 1), generator=gen).to(device)
    generate_seconds(model, prompts, steps + 8)  # warm-up (compiles)
    long, short = (generate_seconds(model, prompts, n) for n in (steps + 8, 8))
    return (long - short) / steps * 1e3


def try_compile(model, wanted: bool) -> bool:
    """``torch.compile`` the forward (HF's static-cache recipe) if ``wanted``; False: eager."""
    import torch

    if not wanted:
        return False
    try:
        model.forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
    except Exception as e:  # noqa: BLE001 (any failure means eager, reported)
        print(f"torch.compile failed ({type(e).__name__}: {e}); eager", flush=True)
        return False
    return True


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen3-30b-a3b", help="qwen3-8b or qwen3-30b-a3b")
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--layers", type=int, default=None, help="default: the model's")
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", default="benchmarks/engine_decode.jsonl")
    return ap.parse_args(argv)


def main(argv=None) -> list[dict]:
    import torch

    from scripts.plan_memory import PRESETS

    args = parse_args(argv)
    cfg = PRESETS[args.model]
    cfg = dataclasses.replace(cfg, num_layers=args.layers or cfg.num_layers)
    model = random_model(hf_config(cfg), args.device)
    compiled = try_compile(model, args.compile)
    device = torch.cuda.get_device_name() if args.device == "cuda" else args.device
    mode = "compiled" if compiled else "eager"
    print(f"{'B':>4} {'ctx':>5} {'ms/step':>8}  HF {mode}, {args.model}, device {device}")
    rows = []
    for b in (int(x) for x in args.batches.split(",")):
        try:
            ms = step_ms(model, b, args.context, args.steps, args.device)
        except Exception as e:  # noqa: BLE001 (e.g. a compile failure at run time: reported)
            print(f"{b:>4} {args.context:>5} failed: {type(e).__name__}: {e}", flush=True)
            continue
        print(f"{b:>4} {args.context:>5} {ms:8.2f}", flush=True)
        rows.append(
            dict(
                bench="hf_decode",
                mode=mode,
                model=args.model,
                layers=cfg.num_layers,
                batch=b,
                context=args.context,
                ms_per_step=ms,
                device=device,
                date=datetime.date.today().isoformat(),
            )
        )
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "a") as f:
            f.write(json.dumps(rows[-1]) + "\n")
    return rows


if __name__ == "__main__":
    main()
