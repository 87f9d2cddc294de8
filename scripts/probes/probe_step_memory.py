"""Probe: device memory the compiled engine step needs beyond its arguments (compile only).

Lowers and compiles the jit step for the Qwen3-8B architecture (``--layers`` of it) on abstract
inputs (nothing is allocated) and prints XLA's memory analysis: argument, output, alias and temp
bytes. A temp size that grows with the KV pool (``--pages``) means the step copies the pool.

``--kernels SPEC``: the kernel config (`KernelConfig.parse`, resolved for the platform as the engine
does; default: the engine's).

    python scripts/probes/probe_step_memory.py --layers 4 --pages 4000 16000 --mode decode prefill
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, nargs="+", default=[4])
    ap.add_argument("--pages", type=int, nargs="+", default=[4000, 16000])
    ap.add_argument("--mode", nargs="+", default=["decode", "prefill"])
    ap.add_argument(
        "--kernels",
        default="",
        metavar="SPEC",
        help="kernel config (KernelConfig.parse); '' = the engine's default",
    )
    args = ap.parse_args()

    import jax
    import jax.numpy as jnp

    from jaxinfer.config import ModelConfig
    from jaxinfer.models import Packing, abstract_params
    from jaxinfer.models.kernels import model_kernels
    from jaxinfer.models.kv_cache import KVCache
    from jaxinfer.runner.sampling import SamplingMetadata
    from jaxinfer.runner.step import StepInput
    from scripts.decode_step import QWEN3_8B, make_step_fn, resolve_kernels

    S = jax.ShapeDtypeStruct
    dt = jnp.bfloat16
    print(
        f"{'mode':<8} {'L':>3} {'pages':>6} {'pool GB':>8} {'temp GB':>8} {'arg GB':>8} "
        f"{'alias GB':>8} {'compile s':>9}"
    )
    for L in args.layers:
        cfg = ModelConfig(**dict(QWEN3_8B, num_layers=L))
        try:
            kc = resolve_kernels(cfg, args.kernels)
        except ValueError as e:
            ap.error(str(e))
        params = abstract_params(cfg, dt)
        for mode in args.mode:
            fn = make_step_fn(cfg, model_kernels(kc), True)
            for P in args.pages:
                pool = S((L, P, cfg.num_kv_heads, 16, cfg.head_dim), dt)
                if mode == "prefill":
                    R, Tq, Tp, M = 8, 1024, 6144, 64
                    pk = Packing(S((R, Tq), jnp.int32), S((R, Tq), jnp.int32), S((Tp,), jnp.int32))
                    tok = S((1, Tp), jnp.int32)
                else:
                    R, M, pk = 256, 128, None
                    tok = S((R, 1), jnp.int32)
                kv = KVCache(pool, pool, S((R, M), jnp.int32), S((R,), jnp.int32))
                f32, i32 = S((R,), jnp.float32), S((R,), jnp.int32)
                sm = SamplingMetadata(
                    f32, i32, f32, f32, f32, S((R,), jnp.uint32), i32, S((R, 0), jnp.int32)
                )
                t = time.perf_counter()
                ma = (
                    fn.lower(params, kv, StepInput(tok, tok, tok, i32, sm, pk))
                    .compile()
                    .memory_analysis()
                )
                gb = lambda b: b / 1e9  # noqa: E731
                print(
                    f"{mode:<8} {L:>3} {P:>6} {gb(2 * pool.size * 2):>8.2f} "
                    f"{gb(ma.temp_size_in_bytes):>8.2f} {gb(ma.argument_size_in_bytes):>8.2f} "
                    f"{gb(ma.alias_size_in_bytes):>8.2f} {time.perf_counter() - t:>9.1f}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
