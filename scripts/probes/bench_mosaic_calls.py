"""The Mosaic GPU decode kernel timed per call inside one jitted program of R calls (wall clock and
CUPTI kernel time), at the issue's shapes, against the device-to-device copy ceiling and JAX's
in-tree Pallas paged attention; plus a control program of tiny XLA ops (the per-call overhead).

    python scripts/probes/bench_mosaic_calls.py [--quick]
"""

from __future__ import annotations

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from pallas_kernels.paged_attention import mosaic, reference  # noqa: E402


def ref_out(q, k_pool, v_pool, tables, lens, **kw):
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    return np.asarray(
        reference.paged_decode_attention(f32(q), f32(k_pool), f32(v_pool), tables, lens, **kw)
    )


def _copy_ceiling_tbs() -> float:
    """Best of PyTorch copy_ and JAX x * 1.0001 on 2 GiB bf16, bytes read + written."""
    import time

    best = 0.0
    try:
        import torch

        a = torch.randn(2**30, device="cuda", dtype=torch.bfloat16)
        b = torch.empty_like(a)
        for _ in range(3):
            b.copy_(a)
        ts = []
        for _ in range(10):
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            b.copy_(a)
            e1.record()
            torch.cuda.synchronize()
            ts.append(e0.elapsed_time(e1) / 1e3)
        best = max(best, 2 * a.numel() * 2 / np.median(ts) / 1e12)
        del a, b
        torch.cuda.empty_cache()
    except Exception as e:  # torch missing
        print("torch copy failed:", e)
    x = jax.random.normal(jax.random.key(0), (2**30,), jnp.bfloat16)
    f = jax.jit(lambda x: x * 1.0001)
    f(x).block_until_ready()
    ts = []
    for _ in range(10):
        t0 = time.perf_counter()
        f(x).block_until_ready()
        ts.append(time.perf_counter() - t0)
    jx = 2 * x.size * 2 / np.median(ts) / 1e12
    print(f"copy ceilings: torch {best:.2f} TB/s, jax x*1.0001 {jx:.2f} TB/s")
    return max(best, jx)


def _time_calls(fn, args_list, shared, trials=20):
    """Seconds per call of ``fn(*args, *shared)``, R calls (one per args) in one jitted program.

    Returns (wall median, CUPTI device time of all kernels per call, CUPTI time of the longest
    kernel per call); the CUPTI figures are medians over 5 runs (None if CUPTI is unavailable).
    """
    import time

    R = len(args_list)
    g = jax.jit(lambda a, sh: [fn(*x, *sh) for x in a])
    for _ in range(5):
        jax.block_until_ready(g(args_list, shared))
    t_end = time.perf_counter() + 0.3  # let the clocks ramp up
    while time.perf_counter() < t_end:
        jax.block_until_ready(g(args_list, shared))
    ts = []
    for _ in range(trials):
        t0 = time.perf_counter()
        jax.block_until_ready(g(args_list, shared))
        ts.append((time.perf_counter() - t0) / R)
    dev = main_k = None
    try:
        from jax.experimental.mosaic.gpu import profiler

        _, runs = profiler.measure(g, aggregate=False, iterations=5)(args_list, shared)
        totals, mains = [], []
        for run in runs:
            by_name = {}
            for name, ms in run:
                by_name[name] = by_name.get(name, 0.0) + ms
            totals.append(sum(by_name.values()) / R * 1e-3)
            mains.append(max(by_name.values()) / R * 1e-3)
        dev, main_k = float(np.median(totals)), float(np.median(mains))
        print("kernels of one program:", {k: round(v, 4) for k, v in by_name.items()})
    except Exception as e:  # CUPTI missing or busy
        print("CUPTI timing failed:", type(e).__name__, str(e)[:200])
    return float(np.median(ts)), dev, main_k


def _bench_shape(B, ctx, configs, *, N=32, K=8, H=128, page=16, R=8, intree=False, seed=0):
    dtype = jnp.bfloat16
    M = ctx // page
    P = max(B * M + 1, 16384 if B * M < 4096 else 0)
    ks = jax.random.split(jax.random.key(seed), 5)
    k_pool = jax.random.normal(ks[0], (1, P, K, page, H), dtype)
    v_pool = jax.random.normal(ks[1], (1, P, K, page, H), dtype)
    qs = jax.random.normal(ks[2], (R, B, N, H), dtype)
    tables = jnp.stack(
        [
            jax.random.permutation(k, jnp.arange(1, P))[: B * M].reshape(B, M)
            for k in jax.random.split(ks[3], R)
        ]
    ).astype(jnp.int32)
    lens = jnp.full((B,), ctx, jnp.int32)
    scale = H**-0.5
    kv_bytes = 2 * B * ctx * K * H * 2
    ref = ref_out(qs[0], k_pool, v_pool, tables[0], lens, scale=scale)
    rows = []

    def record(name, fn, shared):
        out = jax.jit(fn)(qs[0], tables[0], *shared)
        rel = np.linalg.norm(np.asarray(out, np.float32) - ref) / np.linalg.norm(ref)
        wall, dev, main_k = _time_calls(fn, [(qs[i], tables[i]) for i in range(R)], shared)
        rows.append((name, wall, dev, main_k, kv_bytes, rel))

    for cfg in configs:
        fn = lambda q, t, k, v, ln, cfg=cfg: mosaic.paged_decode_attention(
            q, k, v, t, ln, scale=scale, config=cfg
        )
        record(
            f"mosaic bk={cfg.block_kv} st={cfg.num_stages} sp={cfg.num_splits}",
            fn,
            (k_pool, v_pool, lens),
        )
    if intree:
        from jax.experimental.pallas.ops.gpu import paged_attention as pa

        kp = jnp.transpose(k_pool[0], (1, 0, 2, 3))
        vp = jnp.transpose(v_pool[0], (1, 0, 2, 3))
        fn = lambda q, t, k, v, ln: pa.paged_attention(
            q * scale, k, v, t, ln, pages_per_compute_block=8, k_splits=8
        )
        record("jax in-tree paged_attention ppcb=8 ks=8", fn, (kp, vp, lens))
    return rows


def main(argv):
    print("jax", jax.__version__, jax.devices()[0].device_kind)
    ceiling = _copy_ceiling_tbs()
    C = mosaic.MosaicDecodeConfig
    plans = [
        (64, 2048, [C(), C(128, 2)], True, 8),
        (8, 32768, [C(), C(64, 2, num_splits=16), C(64, 3, num_splits=8)], False, 4),
        (1, 512, [C(), C(128, 2)], False, 32),
    ]
    if "--quick" in argv:
        plans = [(B, ctx, cfgs[:1], False, R) for B, ctx, cfgs, _, R in plans]
    table = []
    for B, ctx, cfgs, intree, R in plans:
        try:
            for row in _bench_shape(B, ctx, cfgs, intree=intree, R=R):
                table.append((B, ctx) + row)
        except Exception as e:  # keep the other shapes' numbers
            import traceback

            traceback.print_exc()
            table.append((B, ctx, f"FAILED {type(e).__name__}: {str(e)[:200]}", 0, 0, 0, 0, 0))
    # Control: per-call overhead of a program of 32 calls of four tiny XLA fusions (no Pallas).
    xs = [jax.random.normal(jax.random.key(i), (1, 32, 128), jnp.bfloat16) for i in range(32)]
    ctl = lambda x: (jnp.pad(x * 2, ((0, 0), (0, 8), (0, 0)))[:, 3:35] + 1).sum(-1)
    wall, dev, _ = _time_calls(ctl, [(x,) for x in xs], ())
    table.append((0, 0, "control: 4 tiny XLA ops per call", wall, dev, 0.0, 0, 0.0))
    print(
        f"\nceiling (best d2d copy) = {ceiling:.2f} TB/s; wall = per call in a program of R "
        "calls; dev = CUPTI sum of its kernels; kern = the attention kernel alone"
    )
    print(
        f"{'B':>3} {'ctx':>6} {'variant':40s} {'wall us':>8} {'dev us':>7} {'kern us':>7} "
        f"{'TB/s':>5} {'%ceil':>5} {'relerr':>7}"
    )
    for B, ctx, name, wall, dev, main_k, kv_bytes, rel in table:
        t = dev or wall or 1.0
        tbs = kv_bytes / t / 1e12
        print(
            f"{B:>3} {ctx:>6} {name:40s} {wall * 1e6:8.1f} {(dev or 0) * 1e6:7.1f} "
            f"{(main_k or 0) * 1e6:7.1f} {tbs:5.2f} {100 * tbs / ceiling:5.1f} {rel:7.1e}"
        )


if __name__ == "__main__":
    main(sys.argv[1:])
