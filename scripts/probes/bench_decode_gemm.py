"""The decode step's GEMMs in isolation: GPU time per GEMM of each Qwen3-8B projection at small M
(rows = decode batch), per back-end and formulation, from a JAX profiler trace.

Formulations (``--variants``):
  xla          ``x @ w`` (bf16 out), XLA's choice (its autotuned Triton GEMMs or cuBLAS)
  cublas       ``x @ w`` with XLA's Triton GEMM emitter off (every matmul a cuBLAS call)
  {xla,cublas}-partialsS   explicit split-K: ``einsum('msk,skn->smn')`` into f32[S, M, N] partial
               sums, not added up (what a consumer kernel that sums the S partials would read)
  {xla,cublas}-splitS      the same, summed and cast to bf16 in XLA (one more fusion)
  {xla,cublas}-w8a16       fp8 weights (e4m3, per-channel scales; `quantize.quantize_fp8`) stored
               K-major ([N, K], as the engine stores them) through the engine's `layers.dense`:
               the e4m3 weight converted in the GEMM (``dot_general`` over K of both), bf16 x
  {xla,cublas}-w8a8        the same weights, x quantised per token to e4m3 too: the engine's
               `quantize.w8a8_matmul` (``--kernels fp8_gemm=w8a8``), the layout cuBLASLt's fp8
               GEMM reads without a per-call transpose of the weight
  {xla,cublas}-w8a16t, -w8a8t   the same two (their names from before the engine stored fp8
               weights K-major)

Each timed call runs ``--layers`` independent GEMMs (distinct weights and inputs, so the weights
come from HBM, not L2, and XLA cannot merge the dots); the time per GEMM is the sum of the GPU
kernels' durations (reduce kernels included) divided by that count. Reports µs, weight TB/s and
TFLOP/s per GEMM; prints a table and appends JSON objects (bench="decode_gemm") to ``--out``.

    python scripts/probes/bench_decode_gemm.py [--rows 1 64 128 192 256]
        [--shapes wqkv wo down gate_up] [--variants xla cublas cublas-partials4 xla-w8a8]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from jaxinfer.models.layers import Weight, dense  # noqa: E402
from jaxinfer.models.quantize import quantize_fp8  # noqa: E402
from scripts.profile_decode_step import (  # noqa: E402
    add_trace_options,
    kernel_us_per_call,
    require_gpu,
)
from scripts.run_info import device_row  # noqa: E402

# (K, N) of each Qwen3-8B decode GEMM (x[M, K] @ w[K, N])
SHAPES = {"wqkv": (4096, 6144), "wo": (4096, 4096), "gate_up": (4096, 24576), "down": (12288, 4096)}


def gemm_fn(variant: str):
    """(jitted fn over lists of x, w) for one formulation; raises ValueError if unknown."""
    m = re.fullmatch(r"(xla|cublas)(?:-(partials|split)(\d+)|-(w8a16|w8a8)t?)?", variant)
    if not m:
        raise ValueError(
            f"unknown variant {variant!r}: xla, cublas, xla-partialsS, cublas-splitS, "
            "xla-w8a16, cublas-w8a8, ..."
        )
    backend, kind, s = m.group(1), m.group(2) or m.group(4), int(m.group(3) or 1)
    if s < 1:
        raise ValueError(f"variant {variant!r}: the split count must be >= 1")
    opts = None if backend == "xla" else {"xla_gpu_enable_triton_gemm": False}

    def one(x, w):
        if kind is None:
            return x @ w
        if kind in ("w8a16", "w8a8"):  # w: (e4m3 [N, K], f32[N])
            return dense(x, Weight(w[0], w[1], w8a8=kind == "w8a8"))
        M, K = x.shape
        N = w.shape[1]
        if K % s:
            raise ValueError(f"K={K} is not divisible by S={s}")
        p = jnp.einsum(
            "msk,skn->smn",
            x.reshape(M, s, K // s),
            w.reshape(s, K // s, N),
            preferred_element_type=jnp.float32,
        )
        return p if kind == "partials" else p.sum(0).astype(x.dtype)

    return jax.jit(lambda xs, ws: [one(x, w) for x, w in zip(xs, ws)], compiler_options=opts)


def measure(variant: str, M: int, K: int, N: int, layers: int, reps: int) -> dict:
    """Kernel µs per GEMM and the kernels that ran, for one variant and shape."""
    keys = jax.random.split(jax.random.key(0), 2 * layers)
    xs = [jax.random.normal(keys[i], (M, K), jnp.bfloat16) for i in range(layers)]
    ws = [jax.random.normal(keys[layers + i], (K, N), jnp.bfloat16) * 0.02 for i in range(layers)]
    fp8 = variant.endswith(("w8a16", "w8a8", "w8a16t", "w8a8t"))
    if fp8:  # (e4m3 [N, K] K-major, f32[N]) per weight
        ws = [quantize_fp8(w) for w in ws]
    per = kernel_us_per_call(gemm_fn(variant), (xs, ws), layers, reps)
    us = sum(per.values())
    return dict(
        us=us,
        weight_tb_s=K * N * (1 if fp8 else 2) / us / 1e6,
        tflop_s=2 * M * K * N / us / 1e6,
        kernels={k: round(v, 2) for k, v in sorted(per.items(), key=lambda kv: -kv[1])},
    )


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--rows",
        type=int,
        nargs="+",
        default=[1, 64, 128, 192, 256],
        help="M: rows of x (the decode batch)",
    )
    ap.add_argument(
        "--shapes",
        nargs="+",
        default=list(SHAPES),
        choices=list(SHAPES),
        help="Qwen3-8B projections (K, N): " + ", ".join(f"{k} {v}" for k, v in SHAPES.items()),
    )
    ap.add_argument(
        "--variants",
        nargs="+",
        default=["xla", "cublas"],
        help="formulations (see the module docstring): xla, cublas, "
        "{xla,cublas}-partialsS, {xla,cublas}-splitS, {xla,cublas}-w8a16, {xla,cublas}-w8a8, "
        "{xla,cublas}-w8a16t, {xla,cublas}-w8a8t",
    )
    add_trace_options(
        ap, 8, "independent GEMMs per timed call (8 x 33 MB of weights > the 50 MB L2)"
    )
    return ap


def main() -> None:
    ap = parser()
    args = ap.parse_args()
    for v in args.variants:
        try:
            gemm_fn(v)  # unknown names and bad numbers fail before any work
        except ValueError as e:
            ap.error(str(e))
    require_gpu(ap)
    meta = device_row("decode_gemm")
    print(f"{'shape':<8} {'M':>4} {'variant':<18} {'us':>8} {'TB/s':>6} {'TFLOP/s':>8}  kernels")
    for name in args.shapes:
        K, N = SHAPES[name]
        for M in args.rows:
            for v in args.variants:
                try:
                    r = measure(v, M, K, N, args.layers, args.reps)
                except Exception as e:  # one failing formulation does not end the sweep
                    print(f"{name:<8} {M:>4} {v:<18} failed: {type(e).__name__}: {e}"[:200])
                    continue
                print(
                    f"{name:<8} {M:>4} {v:<18} {r['us']:>8.2f} {r['weight_tb_s']:>6.2f} "
                    f"{r['tflop_s']:>8.1f}  "
                    + ", ".join(f"{k[:40]} {t}" for k, t in list(r["kernels"].items())[:3]),
                    flush=True,
                )
                with open(args.out, "a") as fh:
                    fh.write(
                        json.dumps(dict(meta, shape=name, M=M, K=K, N=N, variant=v, **r)) + "\n"
                    )


if __name__ == "__main__":
    main()
