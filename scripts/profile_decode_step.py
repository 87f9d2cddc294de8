"""Where a decode step's time goes: GPU kernel time per step, grouped by kernel, from a JAX profiler
trace of the engine's decode step, its jitted forward then its greedy sampler
(`scripts.decode_step`; Qwen3-8B architecture, random bf16 weights, as bench_decode.py).

Traces ``--steps`` steps after warm-up, reads the trace back with ``jax.profiler.ProfileData`` and
prints, per kernel name: launches per step, µs per step and share of the step; plus the busy time
(union of kernel intervals) against the wall time, so the idle gaps between kernels show. Writes the
table as JSON to ``--out`` (and ``$OUT/profile_decode.json`` when ``$OUT`` is set).

The kernels are the engine's: ``--kernels SPEC`` (`KernelConfig.parse`, resolved for the platform
by `jaxinfer.config.resolve`; default: the engine's default), ``--gemm engine`` the engine's GEMM
back-end for the batch. The step's inputs are sent once ("device" inputs): the trace shows the
step's kernels, not the transfers.

    python scripts/profile_decode_step.py [--batch 1] [--context 1024] [--layers 36]
        [--kernels SPEC]
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import re
import sys
import tempfile

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from jaxinfer import models  # noqa: E402
from jaxinfer.config import KernelConfig, ModelConfig  # noqa: E402
from jaxinfer.runner.executor import GEMM_COMPILER_OPTIONS  # noqa: E402
from scripts.decode_step import (  # noqa: E402
    QWEN3_8B,
    knob_error,
    parse_knobs,
    resolve_kernels,
    step_runner,
    time_steps,
)


def kernel_events(xplane_path: str) -> list[tuple[str, int, int]]:
    """(name, start_ns, duration_ns) of every kernel on the first GPU plane's stream lines."""
    from jax.profiler import ProfileData

    data = ProfileData.from_file(xplane_path)
    gpu = [p for p in data.planes if p.name.startswith("/device:GPU")]
    if not gpu:
        raise RuntimeError(f"no GPU plane in {xplane_path}: {[p.name for p in data.planes]}")
    out = []
    for line in gpu[0].lines:
        if "stream" not in line.name.lower():
            continue
        for e in line.events:
            out.append((e.name, int(e.start_ns), int(e.duration_ns)))
    return out


def kernel_us_per_call(fn, args, calls: int, reps: int) -> dict[str, float]:
    """GPU µs per call of each kernel (by `short` name; memcpys left out) when ``fn(*args)``,
    which runs ``calls`` independent instances of the timed operation, is traced ``reps`` times
    after two untimed runs (compile, warm-up)."""
    jax.block_until_ready(fn(*args))
    jax.block_until_ready(fn(*args))
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d):
            for _ in range(reps):
                out = fn(*args)
            jax.block_until_ready(out)
        ev = kernel_events(glob.glob(os.path.join(d, "**", "*.xplane.pb"), recursive=True)[0])
    per = collections.defaultdict(float)
    for name, _, dur in ev:
        if not name.startswith("Memcpy"):
            per[short(name)] += dur / (reps * calls) / 1e3
    return dict(per)


def add_trace_options(ap: argparse.ArgumentParser, layers: int, layers_help: str) -> None:
    """A probe's options for `kernel_us_per_call`: ``--layers`` (default ``layers``: independent
    instances per timed call), ``--reps`` and ``--out`` (JSON lines)."""
    ap.add_argument("--layers", type=int, default=layers, help=layers_help)
    ap.add_argument("--reps", type=int, default=10, help="timed calls per measurement")
    ap.add_argument("--out", default="benchmarks/h200.jsonl", help="JSON lines appended here")


def require_gpu(ap: argparse.ArgumentParser) -> None:
    """argparse's error unless JAX's backend is a GPU (kernels timed from a profiler trace)."""
    if jax.default_backend() != "gpu":
        ap.error(f"this benchmark times GPU kernels; JAX's backend is {jax.default_backend()!r}")


def busy_ns(events) -> int:
    """Length of the union of the kernel intervals (overlapping streams counted once)."""
    total, end = 0, -1
    for _, s, d in sorted(events, key=lambda e: e[1]):
        if s >= end:
            total += d
            end = s + d
        elif s + d > end:
            total += s + d - end
            end = s + d
    return total


def short(name: str) -> str:
    """Kernel names without trailing instance numbers (``loop_fusion_12`` -> ``loop_fusion``)."""
    return re.sub(r"(_\d+)+$", "", name.split("(")[0])[:80]


def layer_sequence(events, anchor: str, which: int = 10) -> list[dict]:
    """The kernels launched from the ``which``-th launch of the first kernel whose name contains
    ``anchor`` (e.g. the attention kernel, once per layer) up to the next one: one layer's
    launches in order, each with its duration and the idle gap before it (µs)."""
    ev = sorted(events, key=lambda e: e[1])
    marks = [i for i, (name, _, _) in enumerate(ev) if anchor in name]
    if len(marks) <= which + 1:
        return []
    out, prev_end = [], None
    for name, start, dur in ev[marks[which] : marks[which + 1]]:
        gap = 0.0 if prev_end is None else max(0, start - prev_end) / 1e3
        out.append(dict(kernel=name[:120], us=dur / 1e3, gap_us_before=gap))
        prev_end = start + dur if prev_end is None else max(prev_end, start + dur)
    return out


def idle_gaps(events) -> list[dict]:
    """Every idle gap between kernels (no kernel running on any stream), in time order, each
    with its length in µs and the kernels before and after it."""
    out, end, last = [], None, None
    for name, start, dur in sorted(events, key=lambda e: e[1]):
        if end is not None and start > end:
            out.append({"us": (start - end) / 1e3, "before": last, "after": name})
        if end is None or start + dur > end:
            end, last = start + dur, name
    return out


def largest_gaps(events, top: int = 10) -> list[dict]:
    """The ``top`` longest of `idle_gaps`."""
    return sorted(idle_gaps(events), key=lambda g: -g["us"])[:top]


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument(
        "--kernels",
        default="",
        metavar="SPEC",
        help="kernel config (KernelConfig.parse), resolved for this platform as the "
        "engine does; '' = the engine's default. Keys: " + KernelConfig.help(),
    )
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument(
        "--gemm",
        default="engine",
        choices=["engine"] + sorted(GEMM_COMPILER_OPTIONS),
        help="GEMM back-end of the forward; engine (default): the engine's choice for "
        "the batch (cuBLAS from cublas_decode_min_batch rows)",
    )
    ap.add_argument(
        "--decode-knobs",
        default="",
        help="tuning keywords of the decode kernel, K=V[,K=V] (e.g. block_kv=128)",
    )
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument(
        "--anchor",
        default="mosaic",
        help="substring of a once-per-layer kernel: one layer's launch sequence "
        "(from one such launch to the next) is printed and saved",
    )
    ap.add_argument("--out", default="benchmarks/profile_decode.json")
    return ap


def traced_events(run, kv, steps: int) -> list[tuple[str, int, int]]:
    """`kernel_events` of ``steps`` back-to-back ``run`` calls under the JAX profiler."""
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d):
            for _ in range(steps):
                toks, kv = run(kv)
            toks.block_until_ready()
        paths = glob.glob(os.path.join(d, "**", "*.xplane.pb"), recursive=True)
        events = kernel_events(paths[0])
    if not events:
        raise RuntimeError("the trace holds no GPU kernel events")
    return events


def kernel_table(events, n: int) -> list[dict]:
    """Per kernel (`short` name), slowest first: launches, µs per step and share of kernel time."""
    agg = collections.defaultdict(lambda: [0, 0])
    for name, _, dur in events:
        agg[short(name)][0] += 1
        agg[short(name)][1] += dur
    kern_us = sum(d for _, _, d in events) / n / 1e3
    return sorted(
        (
            {
                "kernel": k,
                "launches_per_step": c / n,
                "us_per_step": t / n / 1e3,
                "share": t / n / 1e3 / kern_us,
            }
            for k, (c, t) in agg.items()
        ),
        key=lambda r: -r["us_per_step"],
    )


def print_summary(summary: dict, top: int) -> None:
    s = summary
    print(
        f"B={s['B']} ctx={s['context']} layers={s['layers']} attention={s['attention']}: "
        f"untraced {s['wall_ms_per_step_untraced']:.3f} ms/step; "
        f"traced span {s['span_ms_per_step']:.3f} ms, GPU busy {s['busy_ms_per_step']:.3f} ms, "
        f"{s['launches_per_step']:.0f} kernel launches per step"
    )
    print(f"{'kernel':<80} {'n/step':>7} {'us/step':>9} {'share':>6}")
    for r in s["kernels"][:top]:
        print(
            f"{r['kernel']:<80} {r['launches_per_step']:>7.1f} {r['us_per_step']:>9.1f} "
            f"{r['share']:>6.1%}"
        )
    print("\nlargest idle gaps (us, the kernel before -> the kernel after):")
    for g in s["largest_gaps"]:
        print(f"  {g['us']:>8.1f}  {g['before'][:60]} -> {g['after'][:60]}")
    if seq := s["layer_sequence"]:
        print(
            f"\none layer, in launch order ({len(seq)} kernels, "
            f"{sum(r['us'] for r in seq):.1f} us busy, {sum(r['gap_us_before'] for r in seq):.1f} "
            f"us idle):"
        )
        for r in seq:
            print(f"  {r['kernel']:<80} {r['us']:>7.2f} us  gap {r['gap_us_before']:>5.2f}")


def main() -> None:
    ap = parser()
    args = ap.parse_args()
    cfg = ModelConfig(**dict(QWEN3_8B, num_layers=args.layers))
    try:
        knobs = parse_knobs(args.decode_knobs)
        kc = resolve_kernels(cfg, args.kernels)
    except ValueError as e:
        ap.error(str(e))
    if err := knobs and knob_error(kc, set(knobs)):
        ap.error(err)
    params = models.init_params(cfg, jax.random.key(0), jnp.bfloat16)
    B, ctx, n = args.batch, args.context, args.steps
    run, kv, gemm = step_runner(
        cfg, params, kc, knobs, args.gemm, "device", B, ctx, args.page_size, False
    )
    dt, kv = time_steps(run, kv, n, warmup=4)
    events = traced_events(run, kv, n)
    span_ns = max(s + d for _, s, d in events) - min(s for _, s, d in events)
    rows = kernel_table(events, n)
    summary = dict(
        B=B,
        context=ctx,
        layers=args.layers,
        attention=kc.decode_attention,
        gemm=gemm,
        steps=n,
        kernel_config=args.kernels,
        decode_knobs=knobs,
        wall_ms_per_step_untraced=dt * 1e3,
        kernel_ms_per_step=sum(d for _, _, d in events) / n / 1e6,
        busy_ms_per_step=busy_ns(events) / n / 1e6,
        span_ms_per_step=span_ns / n / 1e6,
        launches_per_step=len(events) / n,
        device=jax.devices()[0].device_kind,
        jax=jax.__version__,
        kernels=rows,
        layer_sequence=layer_sequence(events, args.anchor),
        largest_gaps=largest_gaps(events),
    )
    print_summary(summary, args.top)
    for path in [args.out] + (
        [os.path.join(os.environ["OUT"], "profile_decode.json")] if os.environ.get("OUT") else []
    ):
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with open(path, "w") as fh:
            json.dump(summary, fh, indent=1)


if __name__ == "__main__":
    main()
