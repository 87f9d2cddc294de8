"""The Qwen3-30B-A3B experts' grouped GEMMs in isolation (issue 47's table of M against GB/s):
GPU time of `jaxinfer.models.moe.grouped_dense` for the gate|up ([E, D, 2 F_e]) and down
([E, F_e, D]) stacks at T tokens a step, each routed to its top-k of E experts by a random
router, from a JAX profiler trace.

Variants (``--variants``):
  xla      ``jax.lax.ragged_dot`` as the engine runs it (XLA's lowering of the ragged dot)
  triton   the same with ``jax_ragged_dot_use_gpu_pallas_triton_lowering`` on (JAX's Pallas
           Triton ragged dot, where this JAX has it)
  gather   each pair's expert matrix gathered, then one batched product (reads k*T matrices)
  pallas[-kK][-nN][-wW][-sS]  `pallas_kernels.moe_gemm.grouped_gemm` (block_k K, block_n N,
           W warps, S stages; default 64, 64, 4, 3)

Each timed call runs ``--layers`` independent grouped GEMMs (distinct stacks, so the experts
come from HBM, not L2). Reports µs per GEMM and GB/s of the distinct experts chosen (the bytes
a grouped GEMM must read): the issue's target is 0.7 of the copy rate. A table, and JSON lines
(bench="moe_gemm") appended to ``--out``.

    python scripts/probes/bench_moe_gemm.py [--tokens 1 4 16 64] [--variants xla triton gather]
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

from jaxinfer.models.moe import grouped_dense, route  # noqa: E402
from pallas_kernels.moe_gemm import grouped_gemm  # noqa: E402
from scripts.profile_decode_step import (  # noqa: E402
    add_trace_options,
    kernel_us_per_call,
    require_gpu,
)
from scripts.run_info import device_row  # noqa: E402

E, K, D, FE = 128, 8, 2048, 768  # Qwen3-30B-A3B: experts, top-k, hidden, expert FFN width
STACKS = {"gate_up": (D, 2 * FE), "down": (FE, D)}
VARIANTS = ("xla", "triton", "gather", "pallas")
_PALLAS = re.compile(r"pallas(?:-k(\d+))?(?:-n(\d+))?(?:-w(\d+))?(?:-s(\d+))?")


def variant_name(v: str) -> str:
    """``v`` if it names a variant, else argparse's error."""
    if v in VARIANTS or _PALLAS.fullmatch(v):
        return v
    raise argparse.ArgumentTypeError(
        f"unknown variant {v!r}: xla, triton, gather, pallas[-kK-nN-wW-sS]"
    )


def routed(T: int, seed: int) -> tuple[jax.Array, jax.Array, int]:
    """(sizes i32[E], each sorted pair's expert i32[T*K], distinct experts) of T random tokens."""
    kx, kr = jax.random.split(jax.random.key(seed))
    x = jax.random.normal(kx, (T, D), jnp.bfloat16)
    _, experts = route(x, jax.random.normal(kr, (D, E), jnp.bfloat16) * 0.02, K, True)
    flat = jnp.sort(experts.reshape(-1))
    sizes = jnp.bincount(flat, length=E).astype(jnp.int32)
    return sizes, flat, int((sizes > 0).sum())


def gemm_fn(variant: str):
    """(jitted fn over lists of xs, ws, with sizes and expert) for one variant."""

    m = _PALLAS.fullmatch(variant)
    knobs = (
        {}
        if m is None
        else {
            name: int(g)
            for name, g in zip(("block_k", "block_n", "num_warps", "num_stages"), m.groups())
            if g
        }
    )

    def one(xs, w, sizes, expert):
        if m is not None:
            return grouped_gemm(xs, w, sizes, **knobs)
        if variant == "gather":
            return jnp.einsum("mi,mio->mo", xs, jnp.take(w, expert, axis=0))
        return grouped_dense(xs, w, sizes, expert)

    def many(xss, ws, sizes, expert):
        return [one(xs, w, sizes, expert) for xs, w in zip(xss, ws)]

    return jax.jit(many)


def measure(variant: str, T: int, stack: str, layers: int, reps: int) -> dict:
    """Kernel µs per grouped GEMM and GB/s of the distinct chosen experts."""
    jax.config.update("jax_ragged_dot_use_gpu_pallas_triton_lowering", variant == "triton")
    n_in, n_out = STACKS[stack]
    sizes, expert, distinct = routed(T, 0)
    keys = jax.random.split(jax.random.key(1), 2 * layers)
    xss = [jax.random.normal(keys[i], (T * K, n_in), jnp.bfloat16) for i in range(layers)]
    ws = [
        jax.random.normal(keys[layers + i], (E, n_in, n_out), jnp.bfloat16) * 0.02
        for i in range(layers)
    ]
    per = kernel_us_per_call(gemm_fn(variant), (xss, ws, sizes, expert), layers, reps)
    us = sum(per.values())
    return dict(
        us=us,
        distinct_experts=distinct,
        gb_s=distinct * n_in * n_out * 2 / us / 1e3,
        kernels={k: round(v, 2) for k, v in sorted(per.items(), key=lambda kv: -kv[1])},
    )


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 16, 64], help="T a step")
    ap.add_argument("--stacks", nargs="+", default=list(STACKS), choices=list(STACKS))
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), type=variant_name)
    add_trace_options(ap, 4, "independent GEMMs per timed call")
    return ap


def main() -> None:
    ap = parser()
    args = ap.parse_args()
    require_gpu(ap)
    meta = device_row("moe_gemm")
    print(f"{'stack':<8} {'T':>4} {'experts':>7} {'variant':<8} {'us':>8} {'GB/s':>7}  kernels")
    for stack in args.stacks:
        for T in args.tokens:
            for v in args.variants:
                try:
                    r = measure(v, T, stack, args.layers, args.reps)
                except Exception as e:  # one failing variant does not end the sweep
                    print(f"{stack:<8} {T:>4} {'':>7} {v:<8} failed: {type(e).__name__}: {e}"[:200])
                    continue
                print(
                    f"{stack:<8} {T:>4} {r['distinct_experts']:>7} {v:<8} {r['us']:>8.1f} "
                    f"{r['gb_s']:>7.0f}  "
                    + ", ".join(f"{k[:40]} {t}" for k, t in list(r["kernels"].items())[:3]),
                    flush=True,
                )
                with open(args.out, "a") as fh:
                    fh.write(json.dumps(dict(meta, stack=stack, T=T, variant=v, **r)) + "\n")


if __name__ == "__main__":
    main()
