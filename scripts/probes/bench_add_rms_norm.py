"""The residual add + RMSNorm kernel (`pallas_kernels.add_rms_norm`) in isolation: GPU µs per call
at decode row counts, per delta form (a bf16 delta, or S float32 partial sums as a split GEMM
leaves them) and warps per program, from a JAX profiler trace.

Each timed call runs 8 independent kernels (distinct inputs) and is repeated ``--reps`` times; the
figure is the kernels' summed duration over all of them, per kernel. Prints a table and appends
JSON objects (bench="add_rms_norm") to ``--out``.

    python scripts/probes/bench_add_rms_norm.py [--rows 1 64 256] [--partials 0 2 16] [--warps 4 8 16]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from pallas_kernels.sizes import is_pow2  # noqa: E402
from scripts.profile_decode_step import kernel_us_per_call  # noqa: E402
from scripts.run_info import git_commit  # noqa: E402

CALLS = 8  # independent kernels per timed call


def measure(rows: int, D: int, partials: int, warps: int, reps: int) -> dict[str, float]:
    """µs per kernel call, by kernel name, for one setting (``partials`` 0: a bf16 delta)."""
    from pallas_kernels.add_rms_norm import triton_pallas
    key = jax.random.key(0)
    xs = [jax.random.normal(jax.random.fold_in(key, i), (rows, D), jnp.bfloat16)
          for i in range(CALLS)]
    shape, dt = ((partials, rows, D), jnp.float32) if partials else ((rows, D), jnp.bfloat16)
    ds = [jax.random.normal(jax.random.fold_in(key, 100 + i), shape, dt) for i in range(CALLS)]
    w = jnp.ones((D,), jnp.bfloat16)
    fn = jax.jit(lambda xs, ds: [triton_pallas.add_rms_norm(x, d, w, eps=1e-6, num_warps=warps)
                                 for x, d in zip(xs, ds)])
    return kernel_us_per_call(fn, (xs, ds), CALLS, reps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 64, 256], help="S: rows per call")
    ap.add_argument("--hidden", type=int, default=4096, help="D (Qwen3-8B: 4096; a power of 2)")
    ap.add_argument("--partials", type=int, nargs="+", default=[0, 2, 16],
                    help="delta as this many float32 partial sums (a power of 2); 0: bf16 delta")
    ap.add_argument("--warps", type=int, nargs="+", default=[4, 8, 16], help="warps per program")
    ap.add_argument("--reps", type=int, default=20, help="timed calls per measurement")
    ap.add_argument("--out", default="benchmarks/h200.jsonl", help="JSON lines appended here")
    args = ap.parse_args()
    for name in ("rows", "partials", "warps"):
        vals = getattr(args, name)
        low = 0 if name == "partials" else 1
        if any(v < low for v in vals):
            ap.error(f"--{name} {vals}: every value must be >= {low}")
    if any(p and not is_pow2(p) for p in args.partials):
        ap.error(f"--partials {args.partials}: the kernel sums a power-of-2 count of partials")
    if not all(is_pow2(w) and w <= 32 for w in args.warps):
        ap.error(f"--warps {args.warps}: Triton takes a power-of-2 count of warps up to 32")
    if not is_pow2(args.hidden):
        ap.error(f"--hidden {args.hidden}: the kernel takes rows of a power-of-2 size")
    if args.reps < 1:
        ap.error(f"--reps {args.reps}: must be >= 1")
    try:
        open(args.out, "a").close()
    except OSError as e:
        ap.error(f"--out {args.out}: cannot append to it ({e.strerror})")
    if jax.default_backend() != "gpu":
        ap.error(f"this benchmark times a GPU kernel from a profiler trace; JAX's backend here is "
                 f"{jax.default_backend()!r}")
    meta = dict(bench="add_rms_norm", date=datetime.date.today().isoformat(), commit=git_commit(),
                jax=jax.__version__, device=jax.devices()[0].device_kind, D=args.hidden)
    print(f"{'rows':>5} {'delta':>8} {'warps':>5} {'us':>7}  kernels")
    for S in args.rows:
        for p in args.partials:
            for nw in args.warps:
                per = measure(S, args.hidden, p, nw, args.reps)
                kern = per.get("add_rms_norm", float("nan"))
                delta = f"f32 x{p}" if p else "bf16"
                print(f"{S:>5} {delta:>8} {nw:>5} {kern:>7.2f}  " + ", ".join(
                    f"{k} {v:.2f}" for k, v in per.items()), flush=True)
                with open(args.out, "a") as fh:
                    fh.write(json.dumps(dict(meta, rows=S, partials=p, num_warps=nw,
                                             us=kern, kernels=per)) + "\n")


if __name__ == "__main__":
    main()
