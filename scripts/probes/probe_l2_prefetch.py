"""Does a one-row GEMM run faster when part of its weight is already in L2?

Probe for overlapping weight reads with the latency-bound kernels of a B=1 decode step: a Pallas
"touch" kernel first reads a fraction of the weight (which leaves it in L2), then XLA's GEMM
``x @ w`` runs. Prints, per setting, the GEMM's GPU µs per call (and the touch kernel's) from a
profiler trace, against the GEMM alone in the same run.

Patterns: ``head`` touches the first fraction of w's rows; ``bands`` touches every band of 64
rows whose index mod 4 is below 4 * fraction (spread over all of K; at fraction 1 the same as
``head``, so not run twice). GPU only. Prints a table; writes no JSON (a probe).

    python scripts/probes/probe_l2_prefetch.py [--shape 4096 4096] [--fractions 0.25 0.5 0.75 1]
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from scripts.profile_decode_step import kernel_us_per_call  # noqa: E402

CALLS = 8  # distinct weights per timed call (8 x 33.5 MB: more than L2 holds)
MIN_BYTES = 4 * 50 * 2**20  # the CALLS weights together: 4x the H200's 50 MB L2, or the
# "none" baseline would itself find its weight in L2
R, BN = 64, 256


def _touch_kernel(w_ref, o_ref, *, m, s, head):
    i, j = pl.program_id(0), pl.program_id(1)
    band = i if head else (i // s) * m + i % s
    t = w_ref[pl.ds(pl.multiple_of(band * R, R), R), pl.ds(pl.multiple_of(j * BN, BN), BN)]
    o_ref[0, :] = jnp.sum(t.astype(jnp.float32), axis=0)


def touch(w, fraction: float, head: bool):
    K, N = w.shape
    m = 4
    s = round(fraction * m)
    nb = round(fraction * K / R) if head else (K // R // m) * s
    return pl.pallas_call(
        functools.partial(_touch_kernel, m=m, s=s, head=head),
        out_shape=jax.ShapeDtypeStruct((nb, N), jnp.float32),
        grid=(nb, N // BN),
        out_specs=pl.BlockSpec((1, BN), lambda i, j: (i, j)),
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
        name="touch",
    )(w)


def measure(K: int, N: int, fraction: float, head: bool, reps: int) -> dict[str, float]:
    key = jax.random.key(0)
    ws = [jax.random.normal(jax.random.fold_in(key, i), (K, N), jnp.bfloat16) for i in range(CALLS)]
    xs = [
        jax.random.normal(jax.random.fold_in(key, 100 + i), (1, K), jnp.bfloat16)
        for i in range(CALLS)
    ]

    def one(x, w):
        if fraction > 0:
            t = touch(w, fraction, head)
            x = x + (t[0, 0] * 0).astype(x.dtype)
        return x @ w

    fn = jax.jit(lambda xs, ws: [one(x, w) for x, w in zip(xs, ws)])
    return kernel_us_per_call(fn, (xs, ws), CALLS, reps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", type=int, nargs=2, default=[4096, 4096], help="K N of w")
    ap.add_argument(
        "--fractions",
        type=float,
        nargs="+",
        default=[0.25, 0.5, 0.75, 1.0],
        help="shares of w touched first: 0.25, 0.5, 0.75 or 1 (default: all four)",
    )
    ap.add_argument("--reps", type=int, default=10, help="traced calls per setting (>= 1)")
    args = ap.parse_args()
    K, N = args.shape
    if K < R or K % (4 * R) or N < BN or N % BN:
        ap.error(f"--shape {K} {N}: K must be a multiple of {4 * R} and N of {BN}")
    if CALLS * K * N * 2 < MIN_BYTES:
        ap.error(
            f"--shape {K} {N}: {CALLS} bf16 weights of that size ({CALLS * K * N * 2 >> 20} "
            f"MiB) would stay in L2; K * N must be at least {MIN_BYTES // (2 * CALLS)}"
        )
    bad = [f for f in args.fractions if not 0 < f <= 1 or abs(f * 4 - round(f * 4)) > 1e-9]
    if bad:
        ap.error(
            f"--fractions {bad}: each must be 0.25, 0.5, 0.75 or 1 (the touched bands of "
            "64 rows are a whole number out of every 4)"
        )
    if args.reps < 1:
        ap.error(f"--reps {args.reps}: must be >= 1")
    if jax.default_backend() != "gpu":
        ap.error(
            f"this probe times GPU kernels from a profiler trace; JAX's backend here is "
            f"{jax.default_backend()!r}"
        )
    print(f"{'pattern':>8} {'frac':>5}  kernels (us per call)")
    settings = [("none", 0.0)] + [
        (p, f) for f in args.fractions for p in ("head", "bands") if p == "head" or f < 1
    ]
    for pat, f in settings:
        per = measure(K, N, f, pat == "head", args.reps)
        print(
            f"{pat:>8} {f:>5.2f}  " + ", ".join(f"{k} {v:.2f}" for k, v in sorted(per.items())),
            flush=True,
        )


if __name__ == "__main__":
    main()
