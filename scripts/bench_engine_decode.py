"""Decode step time through the engine's own loop: B requests of a ``--context``-token random
prompt (greedy, ignore_eos) on a random-weight model of ``--model``'s architecture (a
`scripts.plan_memory.PRESETS` name: qwen3-8b, or the mixture-of-experts qwen3-30b-a3b, whose
bf16 weights take 61 GB; ``--layers`` fewer layers); once every request
has its first token, ``--steps`` engine steps are timed (`LLMEngine.step`, async scheduling as
served: host work overlapped with the device). Prints a table and appends one JSON line per
batch size (bench="engine_decode") to ``--out``. Only the public API is used, so two trees can
be compared in one call.

``--lora-adapters N`` (issue 48's target): the engine runs with ``enable_lora``, ``max_loras=N``,
``max_lora_rank=--lora-rank``, and row i uses random PEFT adapter ``i % N`` (rank ``--lora-rank``,
all seven modules, written under ``--lora-dir``); compare with a run without it (the base step).

``--profile-top N`` (GPU): after the timed steps, 8 more engine steps run under the JAX profiler and
the N kernels with the most time a step are printed (`profile_decode_step.kernel_table`), with the
launches and the GPU's busy time (union of kernel intervals) a step; the row gets them as
``profile``. It shows where a configuration's step goes (LoRA, fp8, MoE), host gaps included.

    python scripts/bench_engine_decode.py [--model qwen3-8b] [--batches 1,64] [--context 1024]
        [--steps 64] [--layers L] [--quantization fp8] [--kernels K=V,...]
        [--lora-adapters N --lora-rank 16] [--label L] [--profile-top N]
        [--out benchmarks/engine_decode.jsonl]
"""

import argparse
import dataclasses
import datetime
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def time_decode(
    llm, batch: int, context: int, steps: int, loras: list, seed: int = 0, profile_top: int = 0
) -> tuple[float, int, dict | None]:
    """(mean ms per engine step of ``steps`` decode steps at ``batch`` rows, programs compiled
    during them, `profile_steps`' summary of 8 more steps if ``profile_top`` else None); row i
    uses ``loras[i % len(loras)]`` (a `LoRARequest`) when ``loras``."""
    from jaxinfer import SamplingParams

    eng, rng = llm.engine, np.random.default_rng(seed)
    prompts = [rng.integers(100, 50000, context - 1).tolist() for _ in range(batch)]
    sp = SamplingParams(temperature=0.0, max_tokens=steps + 16, ignore_eos=True)
    llm.precompile([{"prompt_token_ids": p} for p in prompts], sp)
    for i, p in enumerate(prompts):
        lora = loras[i % len(loras)] if loras else None
        eng.add_request(p, sp, request_id=f"b{batch}-{i}", lora_request=lora)
    while eng.scheduler.waiting or eng.scheduler.prefilling is not None:
        eng.step()
    for _ in range(4):  # every row decoding, the pipeline full
        eng.step()
    lazy, t = eng.stats().num_lazy_compiles, time.perf_counter()
    for _ in range(steps):
        eng.step()
    dt = (time.perf_counter() - t) / steps * 1e3
    lazy = eng.stats().num_lazy_compiles - lazy
    profile = profile_steps(eng, PROFILED_STEPS, profile_top) if profile_top else None
    while eng.has_unfinished():
        eng.step()
    return dt, lazy, profile


PROFILED_STEPS = 8


def profile_steps(eng, n: int, top: int) -> dict:
    """``n`` `LLMEngine.step` calls under the JAX profiler (GPU): {"launches_per_step",
    "kernel_ms_per_step", "busy_ms_per_step", "span_ms_per_step", "kernels": the ``top`` rows of
    `profile_decode_step.kernel_table`}; printed too."""
    import glob
    import tempfile

    import jax

    from scripts.profile_decode_step import busy_ns, kernel_events, kernel_table

    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d):
            for _ in range(n):
                eng.step()
            jax.block_until_ready(eng.runner.kv)
        events = kernel_events(glob.glob(os.path.join(d, "**", "*.xplane.pb"), recursive=True)[0])
    span = max(s + t for _, s, t in events) - min(s for _, s, _ in events)
    out = dict(
        launches_per_step=len(events) / n,
        kernel_ms_per_step=sum(t for _, _, t in events) / n / 1e6,
        busy_ms_per_step=busy_ns(events) / n / 1e6,
        span_ms_per_step=span / n / 1e6,
        kernels=kernel_table(events, n)[:top],
    )
    print(
        f"  profile: {out['launches_per_step']:.0f} launches, GPU busy "
        f"{out['busy_ms_per_step']:.3f} of {out['span_ms_per_step']:.3f} ms a step"
    )
    for r in out["kernels"]:
        print(
            f"  {r['kernel'][:70]:<70} {r['launches_per_step']:>6.1f} {r['us_per_step']:>9.1f} us"
        )
    return out


def lora_requests(cfg, n: int, rank: int, root: str) -> list:
    """``n`` random rank-``rank`` PEFT adapters of ``cfg`` written under ``root`` (the tests'
    writer), as `LoRARequest`s with ids 1..n."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
    from lora_adapters import write_adapter

    from jaxinfer import LoRARequest

    out = []
    for i in range(n):
        path = os.path.join(root, f"adapter{i}")
        write_adapter(path, cfg, rank, seed=i)
        out.append(LoRARequest(f"bench{i}", i + 1, path))
    return out


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--model", default="qwen3-8b", help="qwen3-8b or qwen3-30b-a3b")
    ap.add_argument("--layers", type=int, default=None, help="default: the model's")
    ap.add_argument("--label", default="")
    ap.add_argument("--kernels", default="", help="KernelConfig 'key=value,...' (default: auto)")
    ap.add_argument("--quantization", choices=["fp8"], default=None, help="fp8 weights")
    ap.add_argument("--lora-adapters", type=int, default=0, help="N random adapters (0: none)")
    ap.add_argument("--lora-rank", type=int, default=16)
    ap.add_argument("--lora-dir", default="/tmp/jaxinfer_bench_lora")
    ap.add_argument(
        "--profile-top", type=int, default=0, help="GPU: profile 8 steps, print N kernels"
    )
    ap.add_argument("--out", default="benchmarks/engine_decode.jsonl")
    return ap


def main() -> None:
    args = parser().parse_args()
    # The random weights start JAX before `LLM` can claim vLLM's 0.9 of the card for it (JAX's
    # own default is 0.75: too little for qwen3-30b-a3b's 57 GiB on an 80 GB H100).
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.9")
    import jax
    import jax.numpy as jnp

    from jaxinfer import LLM, models
    from scripts.plan_memory import PRESETS

    cfg = PRESETS[args.model]
    cfg = dataclasses.replace(cfg, num_layers=args.layers or cfg.num_layers)
    batches = [int(b) for b in args.batches.split(",")]
    n = args.lora_adapters
    lora = dict(enable_lora=True, max_loras=n, max_lora_rank=args.lora_rank) if n else {}
    loras = lora_requests(cfg, n, args.lora_rank, args.lora_dir) if n else []
    llm = LLM.from_params(
        cfg,
        models.init_params(cfg, jax.random.key(0), jnp.bfloat16),
        max_model_len=args.context + args.steps + 16,
        max_num_seqs=max(batches),
        quantization=args.quantization,
        **({"kernels": args.kernels} if args.kernels else {}),
        **lora,
    )
    device = jax.devices()[0].device_kind
    print(f"{'label':>10} {'B':>4} {'ctx':>5} {'ms/step':>8} {'compiles':>8}  device {device}")
    for b in batches:
        ms, lazy, profile = time_decode(
            llm, b, args.context, args.steps, loras, profile_top=args.profile_top
        )
        print(f"{args.label:>10} {b:>4} {args.context:>5} {ms:8.2f} {lazy:>8}", flush=True)
        row = dict(
            bench="engine_decode",
            label=args.label,
            model=args.model,
            layers=cfg.num_layers,
            batch=b,
            context=args.context,
            kernels=args.kernels,
            quantization=args.quantization,
            lora_adapters=n,
            lora_rank=args.lora_rank if n else None,
            ms_per_step=ms,
            compiles_in_timed_steps=lazy,
            profile=profile,
            device=device,
            date=datetime.date.today().isoformat(),
        )
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "a") as f:
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
