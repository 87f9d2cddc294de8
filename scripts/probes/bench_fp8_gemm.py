"""fp8-weight GEMMs of decode in isolation: GPU µs per GEMM of each Qwen3-8B projection at small M
(rows = decode batch), bf16 against the fp8 formulations and `pallas_kernels.fp8_gemm` over a sweep
of its knobs, from a JAX profiler trace (the method and helpers of bench_decode_gemm.py).

Variants:
  bf16         ``x @ w``, bf16 weights (the baseline)
  dequant      ``x @ (w.astype(f32) * scale).astype(bf16)`` (`Weight.value`)
  scale_after  ``(x @ w.astype(bf16), f32 accumulation) * scale`` (`dense`'s XLA path)
  fp8:CONFIG   `fp8_matmul` with CONFIG ``block_n:block_k:split_k:num_warps:num_stages``, or
               ``auto`` (`default_knobs`)

Each timed call runs ``--layers`` independent GEMMs (distinct weights, so they come from HBM).
An fp8 variant is first checked against the float32 reference (relative L2 error ``err``; above
`MAX_ERR`: marked WRONG); a config that does not fit a shape or fails to compile is printed and the
sweep goes on. Reports µs, weight TB/s (bytes of the weight as stored) and the ratio to bf16 at the
same (shape, M); prints a table and appends JSON objects (bench="fp8_gemm") to ``--out``. Rows
(M) are the outer loop, in the order given (default: the decode targets' 1 and 64 first); the
sweep stops, saying so, after ``--budget-s`` seconds.

    python scripts/probes/bench_fp8_gemm.py [--rows 1 64 16 128 256] [--shapes wqkv wo gate_up down]
        [--configs auto 128:256:1:4:3 64:512:4:4:4] [--variants bf16 dequant scale_after]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from pallas_kernels.fp8_gemm import FP8, default_knobs, fp8_matmul, fp8_matmul_reference  # noqa: E402
from scripts.probes.bench_decode_gemm import SHAPES  # noqa: E402
from scripts.profile_decode_step import kernel_us_per_call  # noqa: E402
from scripts.run_info import git_commit, xla_flags  # noqa: E402

MAX_ERR = 2e-2  # bf16 output rounding gives ~2^-9; dequant's bf16 weight rounding ~2^-9 too
KNOBS = ("block_n", "block_k", "split_k", "num_warps", "num_stages")
BASELINES = {
    "bf16": lambda x, w, s: x @ w,
    "dequant": lambda x, w, s: x @ (w.astype(jnp.float32) * s).astype(x.dtype),
    "scale_after": lambda x, w, s: (jnp.matmul(x, w.astype(x.dtype),
                                               preferred_element_type=jnp.float32) * s
                                    ).astype(x.dtype),
}


def parse_config(text: str) -> dict | None:
    """``"128:256:1:4:3"`` -> the `KNOBS` dict; ``"auto"`` -> None. ValueError if malformed."""
    if text == "auto":
        return None
    parts = text.split(":")
    if len(parts) != len(KNOBS) or not all(p.isdigit() for p in parts):
        raise ValueError(f"--configs {text!r}: expected 'auto' or "
                         f"{':'.join(KNOBS)} (five integers)")
    return dict(zip(KNOBS, map(int, parts)))


def operands(K: int, N: int, rows: list[int], layers: int) -> dict:
    """Per shape: bf16 and fp8 weights (``layers`` of each), f32 scales, x bf16 per M."""
    keys = jax.random.split(jax.random.key(0), 3 * layers)
    wf = [jax.random.normal(keys[i], (K, N), jnp.float32) for i in range(layers)]
    scales = [jax.random.uniform(keys[layers + i], (N,), jnp.float32, 1e-4, 1e-3)
              for i in range(layers)]
    out = dict(bf16=[(w * 0.02).astype(jnp.bfloat16) for w in wf], scales=scales,
               fp8=[jnp.clip(w * 100, -448, 448).astype(FP8) for w in wf])
    del wf
    out["x"] = {M: [jax.random.normal(keys[2 * layers + i], (M, K), jnp.bfloat16)
                    for i in range(layers)] for M in rows}
    return out


def gemm_fn(variant: str, knobs: dict | None):
    """Jitted ``(xs, ws, ss) -> [y]`` of one variant (``fp8:...``: the kernel with ``knobs``)."""
    one = (BASELINES[variant] if not variant.startswith("fp8:") else
           lambda x, w, s: fp8_matmul(x, w, s, **(knobs or {})))
    return jax.jit(lambda xs, ws, ss: [one(x, w, s) for x, w, s in zip(xs, ws, ss)])


def measure(variant: str, knobs, ops: dict, M: int, layers: int, reps: int) -> dict:
    """µs per GEMM, the kernels that ran and (kernel variants) the relative L2 error vs the
    float32 reference on the first operands."""
    ws = ops["bf16"] if variant == "bf16" else ops["fp8"]
    fn, xs = gemm_fn(variant, knobs), ops["x"][M]
    args = (xs[:layers], ws[:layers], ops["scales"][:layers])
    row = {}
    if variant != "bf16":
        got = np.asarray(fn(*args)[0], np.float64)
        want = np.asarray(fp8_matmul_reference(xs[0], ws[0], ops["scales"][0]), np.float64)
        row["err"] = float(np.linalg.norm(got - want) / np.linalg.norm(want))
        row["ok"] = row["err"] <= MAX_ERR
    per = kernel_us_per_call(fn, args, layers, reps)
    us = sum(per.values())
    K, N = ws[0].shape
    return dict(row, us=us, weight_tb_s=K * N * ws[0].dtype.itemsize / us / 1e6,
                kernels={k: round(v, 2) for k, v in sorted(per.items(), key=lambda kv: -kv[1])})


def short_error(e: Exception) -> str:
    """A compile error's type, first and last lines (Triton's messages are long)."""
    text = f"{type(e).__name__}: {e}".strip()
    return text if len(text) <= 700 else text[:350] + " [...] " + text[-350:]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 64, 16, 128, 256],
                    help="M: rows of x (the decode batch), the outer loop in this order")
    ap.add_argument("--shapes", nargs="+", default=["wqkv", "wo", "gate_up", "down"],
                    choices=list(SHAPES))
    ap.add_argument("--variants", nargs="+", default=list(BASELINES), choices=list(BASELINES))
    ap.add_argument("--configs", nargs="*", default=["auto", "128:256:1:4:3", "64:512:4:4:4"],
                    help="kernel knobs, each 'auto' or " + ":".join(KNOBS))
    ap.add_argument("--layers", type=int, default=8, help="independent GEMMs per timed call")
    ap.add_argument("--reps", type=int, default=5, help="timed calls per measurement")
    ap.add_argument("--budget-s", type=float, default=220.0,
                    help="stop the sweep (and say so) after this many seconds")
    ap.add_argument("--out", default="benchmarks/h200.jsonl", help="JSON lines appended here")
    args = ap.parse_args()
    try:
        configs = {c: parse_config(c) for c in args.configs}
    except ValueError as e:
        ap.error(str(e))
    if jax.default_backend() != "gpu":
        ap.error(f"this probe times GPU kernels from a profiler trace; JAX's backend here is "
                 f"{jax.default_backend()!r}")
    meta = dict(bench="fp8_gemm", date=datetime.date.today().isoformat(), commit=git_commit(),
                jax=jax.__version__, device=jax.devices()[0].device_kind, xla_flags=xla_flags())
    variants = [(v, None) for v in args.variants] + [("fp8:" + c, k) for c, k in configs.items()]
    start = time.perf_counter()
    print(f"{'shape':<8} {'M':>4} {'variant':<20} {'us':>8} {'TB/s':>6} {'/bf16':>6} {'err':>8}"
          "  knobs; kernels")
    ops = {name: operands(*SHAPES[name], args.rows, args.layers) for name in args.shapes}
    for M in args.rows:
        for name in args.shapes:
            K, N = SHAPES[name]
            bf16_us = None
            for v, knobs in variants:
                if time.perf_counter() - start > args.budget_s:
                    print(f"stopped: --budget-s {args.budget_s} s spent")
                    return
                if v.startswith("fp8:") and knobs is None:
                    knobs = default_knobs(M, K, N)
                tag = f"{name:<8} {M:>4} {v:<20}"
                try:
                    r = measure(v, knobs, ops[name], M, args.layers, args.reps)
                except Exception as e:  # one failing config does not end the sweep
                    print(f"{tag} failed ({knobs}): {short_error(e)}", flush=True)
                    continue
                bf16_us = r["us"] if v == "bf16" else bf16_us
                r["vs_bf16"] = r["us"] / bf16_us if bf16_us else None
                print(f"{tag} {r['us']:>8.2f} {r['weight_tb_s']:>6.2f} "
                      f"{r['vs_bf16'] or float('nan'):>6.2f} {r.get('err', 0.0):>8.1e}  "
                      + ("WRONG " if r.get("ok") is False else "")
                      + (":".join(str(knobs[k]) for k in KNOBS) + "; " if knobs else "")
                      + ", ".join(f"{k[:32]} {t}" for k, t in list(r["kernels"].items())[:2]),
                      flush=True)
                with open(args.out, "a") as fh:
                    fh.write(json.dumps(dict(meta, shape=name, M=M, K=K, N=N, variant=v,
                                             knobs=knobs, **r)) + "\n")
    print(f"done in {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
