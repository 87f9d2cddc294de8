"""Probe: device memory the compiled forward needs beyond its arguments (compile only).

Lowers and compiles the engine's jitted forward (`jaxinfer.runner.executor.FORWARD_STEPS`, the
GEMM back-end the engine picks) for the Qwen3-8B architecture (``--layers`` of it) on abstract
inputs (nothing is allocated) and prints XLA's memory analysis: argument, output, alias and temp
bytes. A temp size that grows with the KV pool (``--pages``) means the forward copies the pool.
``--mode``: "decode" (`ForwardKey(--rows, decode=True)`) and "ragged" (`ForwardKey(--tokens,
decode=False)`, the mixed step's prefill; "prefill" is accepted for it); M pages per row from
``--max-model-len``. The sampler never touches the pool, so it is not compiled here.

``--kernels SPEC``: the kernel config (`KernelConfig.parse`, resolved for the platform as the engine
does; default: the engine's).

    python scripts/probes/probe_step_memory.py --layers 4 --pages 4000 16000 --mode decode ragged
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

MODES = {"decode": True, "ragged": False, "prefill": False}  # -> ForwardKey.decode


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, nargs="+", default=[4])
    ap.add_argument("--pages", type=int, nargs="+", default=[4000, 16000])
    ap.add_argument("--mode", nargs="+", default=["decode", "ragged"], choices=list(MODES))
    ap.add_argument("--rows", type=int, default=256, help="decode rows (the largest bucket)")
    ap.add_argument("--tokens", type=int, default=8192, help="ragged tokens (the budget)")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument(
        "--kernels",
        default="",
        metavar="SPEC",
        help="kernel config (KernelConfig.parse); '' = the engine's default",
    )
    return ap


def analysis(cfg, kc, key, P: int, args):
    """XLA's memory analysis of the forward of ``key`` over a pool of P pages, and compile s."""
    import jax
    import jax.numpy as jnp

    from jaxinfer.models import abstract_params
    from jaxinfer.models.kernels import model_kernels
    from jaxinfer.runner.executor import FORWARD_STEPS
    from jaxinfer.step_input import SamplerKey, Sizes, StepShape, allocate, pack
    from scripts.decode_step import engine_gemm, kv_pool

    S, i32 = jax.ShapeDtypeStruct, jnp.int32
    M, rows = -(-args.max_model_len // 16), args.rows
    sizes = Sizes(M, args.max_model_len, -(-cfg.vocab_size // 32), rows)
    buf = pack(allocate(StepShape(key, SamplerKey(0, "greedy")), sizes), "forward")
    pool = S((cfg.num_layers, P, cfg.num_kv_heads, 16, cfg.head_dim), jnp.bfloat16)
    gemm = engine_gemm(kc, key.tokens) if key.decode else kc.prefill_gemm
    t = time.perf_counter()
    low = FORWARD_STEPS[gemm].lower(
        abstract_params(cfg, jnp.bfloat16),
        kv_pool(pool, pool),
        S(buf.shape, i32),
        S((rows,), i32),
        key=key,
        sizes=sizes,
        cfg=cfg,
        kernels=model_kernels(kc),
    )
    ma = low.compile().memory_analysis()
    return ma, time.perf_counter() - t


def main() -> None:
    ap = parser()
    args = ap.parse_args()
    from jaxinfer.config import ModelConfig
    from jaxinfer.step_input import ForwardKey
    from scripts.decode_step import QWEN3_8B, resolve_kernels

    print(
        f"{'mode':<8} {'L':>3} {'pages':>6} {'pool GB':>8} {'temp GB':>8} {'arg GB':>8} "
        f"{'alias GB':>8} {'compile s':>9}"
    )
    gb = lambda b: b / 1e9  # noqa: E731
    for L in args.layers:
        cfg = ModelConfig(**dict(QWEN3_8B, num_layers=L))
        try:
            kc = resolve_kernels(cfg, args.kernels)
        except ValueError as e:
            ap.error(str(e))
        for mode in args.mode:
            decode = MODES[mode]
            key = ForwardKey(args.rows if decode else args.tokens, decode)
            for P in args.pages:
                ma, dt = analysis(cfg, kc, key, P, args)
                pool_bytes = 2 * L * P * cfg.num_kv_heads * 16 * cfg.head_dim * 2
                print(
                    f"{mode:<8} {L:>3} {P:>6} {gb(pool_bytes):>8.2f} "
                    f"{gb(ma.temp_size_in_bytes):>8.2f} {gb(ma.argument_size_in_bytes):>8.2f} "
                    f"{gb(ma.alias_size_in_bytes):>8.2f} {dt:>9.1f}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
