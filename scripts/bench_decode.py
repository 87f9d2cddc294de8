"""Decode-step benchmark on the GPU: the engine's decode step (its jitted forward, model + paged
attention, then its greedy sampler: `scripts.decode_step`) on the Qwen3-8B architecture with random
bf16 (or fp8: ``--quantization``) weights, over batch x context.

Bytes per step = weight bytes read (embedding gather excluded) + KV bytes read (B x context x KV
bytes per token). The kernels are the engine's: each ``--kernels`` spec is parsed with
`KernelConfig.parse` and resolved for this platform with `jaxinfer.config.resolve` (the default
"" is the engine's default), and with ``--gemm engine`` (the default) each batch's forward compiles
with the GEMM back-end the engine picks for it (`StepExecutor.gemm`: cuBLAS from
``cublas_decode_min_batch`` rows). ``--inputs``: "packed" (the engine's way: the forward's and the
sampler's packed buffers sent every step) or "device" (sent once: no host-to-device transfer);
the former "fixed" and "fresh" modes (unpacked inputs) no longer exist. Reports ms/step, tok/s and
achieved bandwidth as a fraction of the best device-to-device copy measured in the same run; marks
the knee of the throughput curve (the last batch whose tok/s gain over the previous batch is
>= 1.5x its batch ratio / 2). Appends JSON objects (bench="decode") to ``benchmarks/h200.jsonl``
and draws ``benchmarks/decode.png``.

    python scripts/bench_decode.py [--layers 36] [--batches 1 8 32 64 128 256]
        [--contexts 1024 4096] [--kernels SPEC [SPEC ...]] [--gemm engine|xla|cublas ...]
        [--inputs packed|device ...] [--decode-knobs K=V ...]
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import sys
import time

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from jaxinfer import models  # noqa: E402
from jaxinfer.config import KernelConfig, ModelConfig  # noqa: E402
from jaxinfer.models.quantize import quantize_params  # noqa: E402
from jaxinfer.runner.executor import GEMM_COMPILER_OPTIONS  # noqa: E402
from scripts.decode_step import (  # noqa: E402
    INPUT_MODES,
    QWEN3_8B,
    check_against_reference,
    dispatch_times,
    knob_error,
    parse_knobs,
    resolve_kernels,
    step_runner,
    time_steps,
)
from scripts.run_info import git_commit, xla_flags  # noqa: E402

SHOWN = ("B", "context", "kernels", "quantization", "variant", "gemm_backend", "inputs")
SHOWN += ("decode_knobs", "ms_per_step", "tok_s", "tbps", "frac_of_copy", "dispatch_ms")
SHOWN += ("compile_s",)


def variant_of(row: dict) -> tuple:
    """What a row compares side by side at one (context, B)."""
    return (
        row["gemm"],
        row["inputs"],
        row["decode_knobs"],
        row.get("kernels", ""),
        row.get("quantization", "none"),
    )


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64, 128, 256])
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument(
        "--kernels",
        nargs="+",
        default=[""],
        metavar="SPEC",
        help="kernel configs compared side by side, one KernelConfig.parse spec per argument, "
        "resolved for this platform as the engine does; '' = the engine's default. Keys: "
        + KernelConfig.help(),
    )
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument(
        "--gemm",
        nargs="+",
        default=["engine"],
        choices=["engine"] + sorted(GEMM_COMPILER_OPTIONS),
        help="GEMM back-ends of the forward compared side by side; engine (default): the "
        "engine's per-batch choice (cuBLAS from the spec's cublas_decode_min_batch rows)",
    )
    ap.add_argument(
        "--scatter-pages",
        action="store_true",
        help="each row's pages in random order across the pool (as after many allocations), "
        "instead of contiguous",
    )
    ap.add_argument(
        "--inputs",
        nargs="+",
        default=["packed"],
        choices=INPUT_MODES,
        help="how step inputs reach the device each step, compared side by side "
        "(decode_runner): packed (the engine's way) or device (sent once)",
    )
    ap.add_argument(
        "--decode-knobs",
        nargs="+",
        default=[""],
        metavar="K=V[,K=V]",
        help="tuning keywords of the decode kernel, one set per argument, compared side by "
        "side (e.g. num_splits=1 num_splits=4 for mosaic); '' = defaults",
    )
    _more_args(ap)
    return ap


def _more_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument(
        "--no-check",
        action="store_true",
        help="skip the first check of each kernel config against the reference kernels (one "
        "decode step's logits, smallest batch and context)",
    )
    ap.add_argument(
        "--quantization",
        nargs="+",
        default=["none"],
        choices=["none", "fp8"],
        help="weights compared side by side: none (bf16), fp8 (the engine's "
        "quantization='fp8': e4m3, per-output-channel scales)",
    )
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--max-kv-gib", type=float, default=100.0)
    ap.add_argument("--out", default="benchmarks/h200.jsonl")
    ap.add_argument("--png", default="benchmarks/decode.png")


def settings(ap, args) -> tuple:
    """(cfg, knob sets by argument, resolved kernels by (spec, quantization)), checked before
    any device work: specs, the platform, knobs against the kernel. Exits on a bad one."""
    cfg = ModelConfig(**dict(QWEN3_8B, num_layers=args.layers))
    try:
        knob_sets = {k: parse_knobs(k) for k in args.decode_knobs}
        kcs = {
            (spec, q): resolve_kernels(cfg, spec, quantization=q)
            for spec, q in itertools.product(args.kernels, args.quantization)
        }
    except ValueError as e:
        ap.error(str(e))
    knob_names = {n for knobs in knob_sets.values() for n in knobs}
    for err in filter(None, (knob_names and knob_error(kc, knob_names) for kc in kcs.values())):
        ap.error(err)
    return cfg, knob_sets, kcs


def check_kernels(args, cfg, params, knob_sets, kcs) -> None:
    """Each kernel config and knob set against the reference (`check_against_reference`)."""
    for (spec, q), kc in kcs.items():
        print(f"kernels {spec!r} -> {kc}, quantization {q}")
        for knobs in [] if args.no_check else args.decode_knobs:
            b, c = min(args.batches), min(args.contexts)
            err = check_against_reference(
                cfg, params[q], kc, knob_sets[knobs], b, c, args.page_size
            )
            print(
                f"  {knobs or 'default knobs'}: logits vs the reference kernels, relative "
                f"error {err:.2e}",
                flush=True,
            )


def measure(args, cfg, params, kc, knobs: dict, variant: tuple, B: int, ctx: int) -> dict:
    """One row's timings: compile, back-to-back steps, dispatch (no metadata)."""
    gemm, inputs = variant[:2]
    run, kv, backend = step_runner(
        cfg, params, kc, knobs, gemm, inputs, B, ctx, args.page_size, args.scatter_pages
    )
    t = time.perf_counter()
    toks, kv = run(kv)  # compile
    toks.block_until_ready()
    compile_s = time.perf_counter() - t
    dt, kv = time_steps(run, kv, args.steps)
    disp, alone, kv = dispatch_times(run, kv)
    del kv
    return dict(
        gemm_backend=backend,
        ms_per_step=dt * 1e3,
        tok_s=B / dt,
        dispatch_ms=disp * 1e3,
        isolated_step_ms=alone * 1e3,
        compile_s=compile_s,
    )


def run_all(args, meta, cfg, params, wbytes, knob_sets, kcs, variants) -> list[dict]:
    """A row per (context, batch, variant) whose KV fits ``--max-kv-gib``."""
    rows, kv_tok, ceiling = [], cfg.kv_bytes_per_token(2), meta["copy_tbps"]
    for ctx, B, v in itertools.product(args.contexts, args.batches, variants):
        gemm, inputs, knobs, spec, q = v
        if (kv_gib := B * ctx * kv_tok / 2**30) > args.max_kv_gib:
            print(f"skip B={B} ctx={ctx}: KV {kv_gib:.1f} GiB")
            continue
        kc = kcs[spec, q]
        row = dict(meta, B=B, context=ctx, gemm=gemm, inputs=inputs, decode_knobs=knobs)
        row.update(kernels=spec, quantization=q, variant=kc.decode_attention)
        row.update(cublas_decode_min_batch=kc.cublas_decode_min_batch)
        row.update(measure(args, cfg, params[q], kc, knob_sets[knobs], v, B, ctx))
        moved, dt = wbytes[q] + B * ctx * kv_tok, row["ms_per_step"] / 1e3
        row.update(bytes_per_step=moved, tbps=moved / dt / 1e12)
        row["frac_of_copy"] = row["tbps"] / ceiling
        rows.append(row)
        print(json.dumps({k: row[k] for k in SHOWN}))
    return rows


def mark_knees(rows: list[dict], contexts, variants) -> None:
    """``knee`` on the last row of each (context, variant) curve before tok/s stops scaling."""
    for ctx, v in itertools.product(contexts, variants):
        rs = [r for r in rows if r["context"] == ctx and variant_of(r) == v]
        for a, b in zip(rs, rs[1:]):
            if b["tok_s"] / a["tok_s"] < 0.5 * b["B"] / a["B"] and not any(
                r.get("knee") for r in rs
            ):
                a["knee"] = True


def write_rows(rows: list[dict], out: str) -> None:
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    for path, mode in [(out, "a")] + (
        [(os.path.join(os.environ["OUT"], "decode.jsonl"), "w")] if os.environ.get("OUT") else []
    ):
        with open(path, mode) as fh:
            fh.writelines(json.dumps(r) + "\n" for r in rows)


def plot(rows: list[dict], args, variants, device: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no PNG")
        return
    fig, ax = plt.subplots(figsize=(7, 5))
    for ctx, (gemm, inputs, knobs, spec, q) in itertools.product(args.contexts, variants):
        sel = [
            r
            for r in rows
            if r["context"] == ctx and variant_of(r) == (gemm, inputs, knobs, spec, q)
        ]
        if not sel:
            continue
        x, y = zip(*[(r["B"], r["tok_s"]) for r in sel])
        label = f"context {ctx}, {gemm} GEMMs, {inputs} inputs" + (f", {knobs}" if knobs else "")
        label += f", kernels {spec or 'default'} ({sel[0]['variant']})"
        ax.plot(x, y, marker="o", label=label + ("" if q == "none" else f", {q} weights"))
        for r in (r for r in sel if r.get("knee")):
            ax.annotate("knee", (r["B"], r["tok_s"]))
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch")
    ax.set_ylabel("decode tok/s")
    ax.set_title(f"Qwen3-8B arch decode step, {device}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.png, dpi=120)
    if os.environ.get("OUT"):
        fig.savefig(os.path.join(os.environ["OUT"], os.path.basename(args.png)), dpi=120)


def print_table(rows: list[dict]) -> None:
    print("\ndispatch: host ms for one step's calls to return with the device idle (launch cost)")
    print(
        f"\n{'B':>4} {'ctx':>5} {'gemm':>6} {'inputs':>6} {'ms/step':>8} {'tok/s':>8} "
        f"{'GB/step':>8} {'TB/s':>6} {'frac':>5} {'dispatch':>8} {'weights':>7}  kernels / knobs"
    )
    for r in rows:
        print(
            f"{r['B']:>4} {r['context']:>5} {r['gemm_backend']:>6} {r['inputs']:>6} "
            f"{r['ms_per_step']:>8.2f} {r['tok_s']:>8.0f} {r['bytes_per_step'] / 1e9:>8.2f} "
            f"{r['tbps']:>6.2f} {r['frac_of_copy']:>5.2f} {r['dispatch_ms']:>8.2f} "
            f"{r['quantization'].replace('none', 'bf16'):>7}  {r['kernels'] or 'default'} "
            f"({r['variant']}) {r['decode_knobs'] or '-'}{'  <- knee' if r.get('knee') else ''}"
        )


def main() -> None:
    ap = parser()
    args = ap.parse_args()
    cfg, knob_sets, kcs = settings(ap, args)
    from bench_paged_attention import copy_ceiling_tbps  # same directory

    ceiling = max((ceil := copy_ceiling_tbps()).values())
    base = models.init_params(cfg, jax.random.key(0), jnp.bfloat16)
    params = {q: base if q == "none" else quantize_params(base) for q in args.quantization}
    wbytes = {  # the embedding: gathered, not read whole
        q: sum(x.nbytes for x in jax.tree_util.tree_leaves(p))
        - cfg.vocab_size * cfg.hidden_size * 2
        for q, p in params.items()
    }
    variants = list(  # compared side by side at every (context, B); a row's: `variant_of`
        itertools.product(
            args.gemm, args.inputs, args.decode_knobs, args.kernels, args.quantization
        )
    )
    meta = dict(
        bench="decode",
        jax=jax.__version__,
        device=jax.devices()[0].device_kind,
        date=datetime.date.today().isoformat(),
        commit=git_commit(),
        xla_flags=xla_flags(),
        layers=args.layers,
        copy_tbps=ceiling,
        page_size=args.page_size,
        scatter_pages=args.scatter_pages,
    )
    print(
        f"copy ceilings {ceil}; weights read/step (GB) "
        + ", ".join(f"{q}: {b / 1e9:.2f}" for q, b in wbytes.items())
    )
    check_kernels(args, cfg, params, knob_sets, kcs)
    rows = run_all(args, meta, cfg, params, wbytes, knob_sets, kcs, variants)
    mark_knees(rows, args.contexts, variants)
    write_rows(rows, args.out)
    plot(rows, args, variants, meta["device"])
    print_table(rows)


if __name__ == "__main__":
    main()
