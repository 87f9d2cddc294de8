"""Tune and time the Triton paged decode kernel at the Qwen3-8B decode shape (device machine).

Validates each variant against the float32 reference first, then sweeps knobs, prints a table,
writes JSON lines of every configuration to $OUT/sweep.jsonl (or /tmp) and the best knobs per
variant to ``pallas_kernels/paged_attention/tuned_h200.json`` (the table `tuning.py` reads; a copy
goes to $OUT too). Usage: python3 scripts/tune_paged_attention.py [--quick]
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pallas_kernels.paged_attention import reference, triton_pallas  # noqa: E402
from pallas_kernels.paged_attention.tuning import TUNED_FILE  # noqa: E402

OUT = os.environ.get("OUT", "/tmp")
B, N, K, H, PS, CTX, L = 64, 32, 8, 128, 16, 2048, 2
M = CTX // PS
KV_BYTES = 2 * B * CTX * K * H * 2


def ceiling():
    res = {}
    try:
        import torch

        a = torch.randn(2**30 // 2, device="cuda", dtype=torch.bfloat16).repeat(2)  # 2 GiB
        b = torch.empty_like(a)
        for _ in range(3):
            b.copy_(a)
        torch.cuda.synchronize()
        ts = []
        for _ in range(10):
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            b.copy_(a)
            e1.record()
            torch.cuda.synchronize()
            ts.append(e0.elapsed_time(e1) / 1e3)
        res["torch_copy_TBps"] = 2 * a.numel() * 2 / np.median(ts) / 1e12
        del a, b
        torch.cuda.empty_cache()
    except Exception as e:  # noqa: BLE001
        res["torch_copy_error"] = repr(e)
    x = jax.random.normal(jax.random.key(0), (2**30,), jnp.bfloat16)
    f = jax.jit(lambda a: a * 1.0001)
    res["jax_scale_TBps"] = 2 * x.size * 2 / timeit(lambda x=x: f(x)) / 1e12
    del x
    return res


def timeit(call, reps=30, rounds=5):
    out = call()
    jax.block_until_ready(out)
    for _ in range(3):
        jax.block_until_ready(call())
    ts = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(reps):
            out = call()
        jax.block_until_ready(out)
        ts.append((time.perf_counter() - t0) / reps)
    return float(np.median(ts))


R = 20


def looped(fn, **kw):
    """One jit running the kernel R times over alternating (traced) layers, like the engine's scan;
    per-call time = loop time / R (no host dispatch between calls)."""

    def run(q, k_pool, v_pool, bt, sl):
        def body(i, acc):
            o = fn(q, k_pool, v_pool, bt, sl, layer=i % L, **kw)
            return acc + o.astype(jnp.float32)

        return jax.lax.fori_loop(0, R, body, jnp.zeros(q.shape, jnp.float32))

    return jax.jit(run)


def time_kernel(fn, args, **kw):
    f = looped(fn, **kw)
    return timeit(lambda: f(*args), reps=3, rounds=5) / R


def make_inputs(seed=0, B=B):
    rng = np.random.default_rng(seed)
    P = B * M + 1
    pages = rng.permutation(np.arange(1, P)).reshape(B, M).astype(np.int32)
    key = jax.random.key(seed)
    k1, k2, k3 = jax.random.split(key, 3)
    q = jax.random.normal(k1, (B, N, H), jnp.bfloat16)
    k_pool = jax.random.normal(k2, (L, P, K, PS, H), jnp.bfloat16)
    v_pool = jax.random.normal(k3, (L, P, K, PS, H), jnp.bfloat16)
    return q, k_pool, v_pool, jnp.asarray(pages), jnp.full((B,), CTX, jnp.int32)


CONFIGS = [  # (pages_per_block, num_warps, num_stages, k_splits)
    (4, 4, 3, 1),
    (4, 4, 3, 2),
    (2, 4, 4, 1),
    (2, 4, 4, 2),
    (2, 4, 3, 2),
    (4, 4, 4, 1),
    (8, 4, 3, 1),
    (8, 8, 3, 1),
    (4, 8, 3, 2),
    (8, 4, 2, 1),
    (2, 4, 5, 2),
    (4, 4, 2, 2),
]


def reference_out(q, k_pool, v_pool, bt, sl, layer, scale):
    """The reference decode attention of these inputs at ``layer`` (q cast to float32 first), as
    the jitted call returns it."""
    return jax.jit(lambda *a: reference.paged_decode_attention(*a[:5], layer=a[5], scale=scale))(
        q.astype(jnp.float32), k_pool, v_pool, bt, sl, layer
    )


def validate_and_time(fn, inputs, layer, scale, knobs, ref, rec, kv_bytes, compile_time=False):
    """Run ``fn`` with ``knobs`` on ``inputs`` (q, k_pool, v_pool, bt, sl) once under jit and
    record into ``rec``, in this order: ``compile_s`` (only with ``compile_time``), ``finite``,
    ``rel_err`` against ``ref``, then the looped per-call time ``us`` and ``TBps`` (``kv_bytes``
    over that time). Exceptions propagate, leaving ``rec`` with the keys set so far."""
    t0 = time.perf_counter()
    f = jax.jit(lambda *a: fn(*a[:5], layer=a[5], scale=scale, **knobs))
    out = np.asarray(f(*inputs, layer), np.float32)
    if compile_time:
        rec["compile_s"] = round(time.perf_counter() - t0, 2)
    rec["finite"] = bool(np.all(np.isfinite(out)))
    rec["rel_err"] = float(np.linalg.norm(out - ref) / np.linalg.norm(ref))
    t = time_kernel(fn, inputs, scale=scale, **knobs)
    rec["us"] = round(t * 1e6, 1)
    rec["TBps"] = round(kv_bytes / t / 1e12, 3)


def knobs_of(ppb, nw, ns, ks):
    """The kernel keyword arguments of one configuration tuple."""
    return dict(pages_per_block=ppb, num_warps=nw, num_stages=ns, k_splits=ks)


def sweep_full_batch(variants, cfgs, quick, inputs, layer, scale, ref, rows, best):
    """Sweep each variant's configurations (the first 3 with ``quick``) at batch B: append and
    print one record per configuration to ``rows``; keep in ``best[variant]`` the fastest finite
    one with rel_err < 1e-2. A failing configuration records its ``error`` and a traceback."""
    for vname, fn in variants.items():
        for ppb, nw, ns, ks in cfgs[vname][:3] if quick else cfgs[vname]:
            rec = dict(variant=vname, pages_per_block=ppb, num_warps=nw, num_stages=ns, k_splits=ks)
            try:
                knobs = knobs_of(ppb, nw, ns, ks)
                validate_and_time(fn, inputs, layer, scale, knobs, ref, rec, KV_BYTES, True)
                ok = rec["finite"] and rec["rel_err"] < 1e-2
                if ok and (vname not in best or rec["us"] < best[vname]["us"]):
                    best[vname] = rec
            except Exception as e:  # noqa: BLE001
                rec["error"] = repr(e)[:400]
                traceback.print_exc(limit=3)
            rows.append(rec)
            print(json.dumps(rec), flush=True)


def sweep_small_batch(variants, best, Bs, layer, scale, rows):
    """At batch ``Bs`` (where the sequence split matters), time each variant's best knobs with
    k_splits 1, 4 and 8; append and print one record per run to ``rows``."""
    inputs = make_inputs(1, B=Bs)
    refs = np.asarray(reference_out(*inputs, layer, scale))
    for vname, fn in variants.items():
        if vname not in best:
            continue
        r0 = best[vname]
        for ks in (1, 4, 8):
            rec = dict(
                variant=vname,
                B=Bs,
                pages_per_block=r0["pages_per_block"],
                num_warps=r0["num_warps"],
                num_stages=r0["num_stages"],
                k_splits=ks,
            )
            try:
                knobs = knobs_of(r0["pages_per_block"], r0["num_warps"], r0["num_stages"], ks)
                validate_and_time(fn, inputs, layer, scale, knobs, refs, rec, KV_BYTES * Bs / B)
            except Exception as e:  # noqa: BLE001
                rec["error"] = repr(e)[:400]
            rows.append(rec)
            print(json.dumps(rec), flush=True)


def tuned_entries(best, rows, device_kind, Bs):
    """The tuned-table entries (the format `tuning.py` reads): per variant its best knobs, with
    ``min_programs`` from the fastest small-batch k_splits, and the measurement behind them."""
    tuned = []
    for vname, r in best.items():
        small = [x for x in rows if x["variant"] == vname and x.get("B") == Bs and "us" in x]
        ks_small = min(small, key=lambda x: x["us"])["k_splits"] if small else 1
        min_programs = (
            max(Bs * K * ks_small, B * K * r["k_splits"])
            if r["k_splits"] > 1
            else Bs * K * ks_small
        )
        tuned.append(
            {
                "variant": vname,
                "device_kind": device_kind,
                "page_size": PS,
                "head_dim": H,
                "group": N // K,
                "dtype": "bfloat16",
                "knobs": {
                    "pages_per_block": r["pages_per_block"],
                    "num_warps": r["num_warps"],
                    "num_stages": r["num_stages"],
                    "min_programs": min_programs,
                },
                "measured": {
                    "B": B,
                    "ctx": CTX,
                    "us": r["us"],
                    "TBps": r["TBps"],
                    "k_splits": r["k_splits"],
                },
            }
        )
    return tuned


def print_table(rows, ceil):
    """Print every record as one table row, then the bandwidth ceilings and the KV bytes."""
    print(
        f"\n{'variant':<10} {'B':>3} {'ppb':>4} {'nw':>3} {'ns':>3} {'ks':>3} {'us':>8} "
        f"{'TB/s':>7} {'rel_err':>9}"
    )
    for r in rows:
        rel_err = f"{r['rel_err']:.1e}" if "rel_err" in r else "-"
        print(
            f"{r['variant']:<10} {r.get('B', B):>3d} {r['pages_per_block']:>4d} "
            f"{r['num_warps']:>3d} {r['num_stages']:>3d} {r['k_splits']:>3d} "
            f"{r.get('us', 'ERR')!s:>8} {r.get('TBps', '-')!s:>7} {rel_err:>9}"
        )
    print("ceilings", ceil, "KV bytes", KV_BYTES)


def main():
    quick = "--quick" in sys.argv
    dev = jax.devices()[0]
    print("device", dev.device_kind, "jax", jax.__version__, flush=True)
    ceil = ceiling()
    print("ceilings", ceil, flush=True)
    inputs = make_inputs()
    layer = jnp.int32(1)
    scale = H**-0.5
    jax.config.update("jax_default_matmul_precision", "highest")
    ref = np.asarray(reference_out(*inputs, layer, scale), np.float32)
    variants = {"triton": triton_pallas.paged_decode_attention}
    rows = []
    best = {}
    cfgs = {
        "triton": [
            (2, 4, 4, 1),
            (4, 4, 4, 1),
            (4, 4, 3, 1),
            (2, 4, 3, 1),
            (8, 8, 3, 1),
            (4, 4, 4, 2),
        ]
    }
    sweep_full_batch(variants, cfgs, quick, inputs, layer, scale, ref, rows, best)
    # small batch: the sequence split matters (B*K = 64 programs)
    Bs = 8
    sweep_small_batch(variants, best, Bs, layer, scale, rows)
    with open(os.path.join(OUT, "sweep.jsonl"), "w") as fh:
        for r in rows:
            fh.write(json.dumps(dict(r, **ceil, device_kind=dev.device_kind)) + "\n")
    tuned = tuned_entries(best, rows, dev.device_kind, Bs)
    for path in (TUNED_FILE, os.path.join(OUT, "tuned_h200.json")):
        with open(path, "w") as fh:
            json.dump(tuned, fh, indent=1)
    print_table(rows, ceil)


if __name__ == "__main__":
    main()
