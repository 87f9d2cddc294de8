"""fp8-weight GEMMs at Qwen3-8B's decode shapes: bf16 ``x @ w``, the engine's dequant path
(`jaxinfer.models.layers.dense`), XLA's scale-after-dot, and the `pallas_kernels.fp8_matmul`
kernels (default knobs, and with ``--sweep N`` the best of N knob sets around them).

Each fp8 implementation is checked against the float32 reference first (relative error < 1e-2).
Time: GPU kernel µs per GEMM from a profiler trace (`profile_decode_step.kernel_us_per_call`; the
f32 split-K sum counted), each timed call running ``--layers`` GEMMs on distinct weight sets so
the weights come from HBM, not L2. GB/s counts weights, x and the output once. Prints a table;
appends JSON objects (bench="fp8_gemm") to ``--out``.

    python scripts/bench_fp8_gemm.py [--rows 1 4 16 64 128 256] [--shapes wqkv gate_up down]
        [--sweep N] [--out benchmarks/h200.jsonl]
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from jaxinfer.models.layers import Weight, dense  # noqa: E402
from pallas_kernels.fp8_matmul import reference, triton_pallas  # noqa: E402
from scripts.run_info import git_commit, xla_flags  # noqa: E402

SHAPES = {"wqkv": (4096, 6144), "gate_up": (4096, 24576), "down": (12288, 4096)}


def baselines() -> dict:
    """name -> fn(x, w, scale) (w bf16 for "bf16", else fp8)."""
    def after_dot(x, w, s):
        acc = jnp.dot(x, w.astype(jnp.bfloat16), preferred_element_type=jnp.float32)
        return (acc * s).astype(jnp.bfloat16)
    return {"bf16": lambda x, w, s: x @ w,
            "dequant": lambda x, w, s: dense(x, Weight(w, s)),
            "scale_after_dot": after_dot}


def candidates(M: int, K: int, N: int) -> list:
    """The default knobs, then variations around them, most promising first."""
    base = triton_pallas.default_config(M, K, N)
    rep = dataclasses.replace
    if M > base.gemv_rows:
        out = [base, rep(base, swap_ab=True), rep(base, splits=base.splits * 2),
               rep(base, swap_ab=True, splits=base.splits * 2)]
        out += [rep(base, block_m=2 * base.block_m)] if M >= 2 * base.block_m else []
    else:
        out = [base, rep(base, splits=base.splits * 4), rep(base, splits=base.splits * 2),
               rep(base, block_k=32)]
    out.append(rep(base, splits=max(1, base.splits // 2)))
    seen, uniq = set(), []
    for c in out:
        if c not in seen and N % c.block_n == 0 and K % (c.splits * c.block_k) == 0:
            seen.add(c)
            uniq.append(c)
    return uniq


def make_inputs(M, K, N, layers, seed=0):
    ks = jax.random.split(jax.random.key(seed), 4)
    xs = list(jax.random.normal(ks[0], (layers, M, K), jnp.float32).astype(jnp.bfloat16))
    w8 = [(jax.random.normal(k, (K, N), jnp.float32) * 16).astype(jnp.float8_e4m3fn)
          for k in jax.random.split(ks[1], layers)]
    s = list(jax.random.uniform(ks[2], (layers, N), minval=1e-3, maxval=1e-2))
    wb = [(w.astype(jnp.float32) * si).astype(jnp.bfloat16) for w, si in zip(w8, s)]
    return xs, w8, wb, s


def measure(fn, xs, ws, ss, reps) -> tuple[float, dict]:
    from scripts.profile_decode_step import kernel_us_per_call
    f = jax.jit(lambda xs, ws, ss: [fn(x, w, s) for x, w, s in zip(xs, ws, ss)])
    per = kernel_us_per_call(f, (xs, ws, ss), len(xs), reps)
    return sum(per.values()), {k: round(v, 2) for k, v in per.items()}


def run_shape(name, M, args, meta):
    K, N = SHAPES[name]
    xs, w8, wb, ss = make_inputs(M, K, N, args.layers)
    want = np.asarray(reference.fp8_matmul(xs[0], w8[0], ss[0]), np.float32)
    fns = dict(baselines())
    cfgs = candidates(M, K, N)[:args.sweep]
    for i, c in enumerate(cfgs):
        fns[f"triton{'' if i == 0 else i}"] = (
            lambda x, w, s, c=c: triton_pallas.fp8_matmul(x, w, s, config=c), c)
    rows = []
    for v, fn in fns.items():
        fn, cfg = fn if isinstance(fn, tuple) else (fn, None)
        row = dict(meta, shape=name, M=M, K=K, N=N, variant=v,
                   config=None if cfg is None else dataclasses.asdict(cfg))
        try:
            ws = wb if v == "bf16" else w8
            got = np.asarray(jax.jit(fn)(xs[0], ws[0], ss[0]), np.float32)
            row["rel_err"] = err = float(np.linalg.norm(got - want) / np.linalg.norm(want))
            if not err < 1e-2:
                raise ValueError(f"validation failed: rel err {err:.3g}")
            us, kernels = measure(fn, xs, ws, ss, args.reps)
            wbytes = K * N * (2 if v == "bf16" else 1)
            row.update(us=us, gb_s=(wbytes + 2 * M * (K + N)) / us / 1e3, kernels=kernels)
        except Exception as e:  # noqa: BLE001 - one failing implementation must not end the sweep
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
        rows.append(row)
        print(f"{name:<8} {M:>4} {v:<16} " + (f"{row['us']:>8.2f} {row['gb_s']:>7.0f}"
              if "us" in row else row["error"][:120]) + (f"  {cfg}" if cfg else ""), flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 64, 128, 256])
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--sweep", type=int, default=1, metavar="N",
                    help="knob sets timed per shape: the default and N - 1 variations of it")
    ap.add_argument("--layers", type=int, default=8, help="weight sets per timed call")
    ap.add_argument("--reps", type=int, default=10, help="timed calls per measurement")
    ap.add_argument("--out", default="benchmarks/h200.jsonl", help="JSON lines appended here")
    args = ap.parse_args()
    if args.sweep < 1:
        ap.error(f"--sweep {args.sweep}: at least 1 (the default knobs)")
    meta = dict(bench="fp8_gemm", date=datetime.date.today().isoformat(), commit=git_commit(),
                jax=jax.__version__, device=jax.devices()[0].device_kind, xla_flags=xla_flags())
    print(f"{'shape':<8} {'M':>4} {'variant':<16} {'us':>8} {'GB/s':>7}")
    summary = []
    for name in args.shapes:
        for M in args.rows:
            rows = run_shape(name, M, args, meta)
            with open(args.out, "a") as fh:
                fh.writelines(json.dumps(r) + "\n" for r in rows)
            ok = [r for r in rows if "us" in r]
            best = min((r for r in ok if r["variant"].startswith("triton")), default=None,
                       key=lambda r: r["us"])
            summary.append((name, M, {r["variant"]: r for r in ok}, best))
    print(f"\n{'shape':<8} {'M':>4} | " + " | ".join(
        f"{v:>15}" for v in ("bf16", "dequant", "scale_after_dot", "triton", "best kernel")))
    for name, M, by, best in summary:
        cells = [by.get(v) for v in ("bf16", "dequant", "scale_after_dot", "triton")] + [best]
        print(f"{name:<8} {M:>4} | " + " | ".join(
            f"{r['us']:7.1f} {r['gb_s']:6.0f}" if r else f"{'-':>15}" for r in cells))


if __name__ == "__main__":
    main()
