"""Paged decode attention on the GPU: every registered variant vs JAX's in-tree Pallas kernel,
cuDNN's paged attention and an XLA gather path, in one run, against the copy ceiling measured in
the same run.

Each implementation is validated against the float32 reference first (bf16 inputs; relative error
bound 2e-2), then timed: a jitted ``lax.fori_loop`` of ``--iters`` calls rotating over 4 query sets
(so launch gaps between calls are device-side only), median of ``--repeats``. KV bytes read per call
= 2 * B * context * K * H * 2. Prints a table; appends one JSON object per configuration to
``benchmarks/h200.jsonl``; draws ``benchmarks/paged_attention.png``.

    python scripts/bench_paged_attention.py [--batches 1 8 64 256] [--contexts 512 2048 8192 32768]
        [--page-sizes 16 64] [--variants triton mosaic] [--max-kv-gib 24]
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

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pallas_kernels.paged_attention import reference, registry  # noqa: E402
from scripts.run_info import git_commit  # noqa: E402

N, K, H = 32, 8, 128


def copy_ceiling_tbps() -> dict:
    """Best device-to-device copy, bytes read + written, through JAX and (if present) PyTorch."""
    out = {}
    n = 1 << 30  # 2 GiB of bf16
    a = jax.random.normal(jax.random.key(0), (n,), jnp.bfloat16)
    f = jax.jit(lambda x: x * 1.0001)
    f(a).block_until_ready()
    ts = []
    for _ in range(10):
        t = time.perf_counter()
        f(a).block_until_ready()
        ts.append(time.perf_counter() - t)
    out["jax_scale"] = 2 * 2 * n / np.median(ts) / 1e12
    del a
    try:
        import torch

        x = torch.randn(n, dtype=torch.bfloat16, device="cuda")
        y = torch.empty_like(x)
        for _ in range(3):
            y.copy_(x)
        torch.cuda.synchronize()
        ev = [
            (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            for _ in range(10)
        ]
        for s, e in ev:
            s.record()
            y.copy_(x)
            e.record()
        torch.cuda.synchronize()
        ms = np.median([s.elapsed_time(e) for s, e in ev])
        out["torch_copy"] = 2 * 2 * n / (ms / 1e3) / 1e12
        del x, y
        torch.cuda.empty_cache()
    except Exception as e:  # noqa: BLE001 - report and continue without it
        print(f"torch copy ceiling unavailable: {type(e).__name__}: {e}")
    return out


def make_inputs(B, ctx, page_size, seed=0):
    M = -(-ctx // page_size)
    P = B * M + 1
    key = jax.random.key(seed)
    k1, k2, k3, k4 = jax.random.split(key, 4)
    k_pool = jax.random.normal(k1, (1, P, K, page_size, H), jnp.bfloat16)
    v_pool = jax.random.normal(k2, (1, P, K, page_size, H), jnp.bfloat16)
    perm = np.random.default_rng(seed).permutation(np.arange(1, P))
    tables = jnp.asarray(perm.reshape(B, M), jnp.int32)
    lens = jnp.full((B,), ctx, jnp.int32)
    qs = jax.random.normal(k3, (4, B, N, H), jnp.bfloat16)
    return qs, k_pool, v_pool, tables, lens


def xla_gather_fn(page_size, scale):
    """The XLA gather path: gather each row's pages, then plain masked softmax attention (float32
    scores), with the engine's call signature."""

    def xla_gather(q, kp, vp, bt, sl):
        B, M = bt.shape
        k = kp[0, bt].transpose(0, 2, 1, 3, 4).reshape(B, K, M * page_size, H)
        v = vp[0, bt].transpose(0, 2, 1, 3, 4).reshape(B, K, M * page_size, H)
        qg = q.reshape(B, K, N // K, H)
        s = jnp.einsum("bkgh,bksh->bkgs", qg, k, preferred_element_type=jnp.float32) * scale
        mask = jnp.arange(M * page_size)[None, None, None] < sl[:, None, None, None]
        p = jax.nn.softmax(jnp.where(mask, s, -jnp.inf), axis=-1)
        o = jnp.einsum("bkgs,bksh->bkgh", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
        return o.reshape(B, N, H).astype(q.dtype)

    return xla_gather


def in_tree_fn(scale):
    """JAX's in-tree Pallas paged attention (pools in its own layout [K, P, ps, H]: see
    run_config), or None, printing why, when it cannot be imported."""
    try:
        from jax.experimental.pallas.ops.gpu import paged_attention as intree
    except ImportError as e:
        print(f"in-tree kernel unavailable: {e}")
        return None

    def in_tree(q, kt, vt, bt, sl):  # pools in its own layout [K, P, ps, H]: see run_config
        # BASELINE's best knobs (8 pages per block, 8 splits) where they divide M
        M = bt.shape[1]
        ks = next(k for k in (8, 4, 2, 1) if M % k == 0)
        ppb = next(p for p in (8, 4, 2, 1) if (M // ks) % p == 0)
        return intree.paged_attention(
            q * scale, kt, vt, bt, sl, pages_per_compute_block=ppb, k_splits=ks
        )

    return in_tree


def cudnn_fn(scale):
    """cuDNN's paged attention with the engine's call signature, or None, printing why, when it
    cannot be imported."""
    try:
        from jax._src.cudnn.fused_attention_stablehlo import paged_attention as cudnn_paged
    except ImportError as e:
        print(f"cuDNN paged attention unavailable: {e}")
        return None

    def cudnn(q, kp, vp, bt, sl):
        # cuDNN wants exactly B * M blocks: drop the null page 0 (never referenced here) and
        # shift the table; its BNSH layout for a block is our [K, page_size, H].
        B, M = bt.shape
        pt = (bt - 1)[:, None, :, None]
        o = cudnn_paged(
            q[:, :, None, :],
            kp[0, 1:],
            vp[0, 1:],
            jnp.ones((B,), jnp.int32),
            sl,
            pt,
            pt,
            scale=scale,
            qkv_layout="BNSH",
        )
        return o[:, :, 0, :]

    return cudnn


def impls(variants, page_size):
    """name -> fn(q [B,N,H], k_pool, v_pool, tables, lens) with the engine's layout."""
    scale = H**-0.5
    out = {}
    for v in variants:
        f = registry.get(v)
        out[v] = lambda q, kp, vp, bt, sl, f=f: f(q, kp, vp, bt, sl, layer=0, scale=scale)
    out["xla_gather"] = xla_gather_fn(page_size, scale)
    in_tree = in_tree_fn(scale)
    if in_tree is not None:
        out["jax_in_tree"] = in_tree
    cudnn = cudnn_fn(scale)
    if cudnn is not None:
        out["cudnn"] = cudnn
    return out


def time_fn(fn, qs, args, iters, repeats):
    def loop(qs, *args):
        def body(i, acc):
            return acc + fn(qs[i % qs.shape[0]], *args)[..., :1].astype(jnp.float32)

        return jax.lax.fori_loop(0, iters, body, jnp.zeros(qs.shape[1:-1] + (1,), jnp.float32))

    f = jax.jit(loop)
    f(qs, *args).block_until_ready()
    ts = []
    for _ in range(repeats):
        t = time.perf_counter()
        f(qs, *args).block_until_ready()
        ts.append((time.perf_counter() - t) / iters)
    return float(np.median(ts))


def run_config(B, ctx, page_size, fns, ceiling, iters, repeats, meta):
    qs, kp, vp, bt, sl = make_inputs(B, ctx, page_size)
    ref = reference.paged_decode_attention(qs[0], kp, vp, bt, sl, scale=H**-0.5).astype(jnp.float32)
    kv_bytes = 2 * B * ctx * K * H * 2
    rows = []
    kt = vt = None
    for name, fn in fns.items():
        args = (kp, vp, bt, sl)
        call = fn
        if name == "jax_in_tree":
            if kt is None:  # transposed once, outside the timing
                kt, vt = kp[0].transpose(1, 0, 2, 3), vp[0].transpose(1, 0, 2, 3)
            args = (kt, vt, bt, sl)
        row = dict(
            meta,
            bench="paged_decode_attention",
            variant=name,
            B=B,
            context=ctx,
            page_size=page_size,
            N=N,
            K=K,
            H=H,
            dtype="bfloat16",
        )
        try:
            out = jax.jit(call)(qs[0], *args).astype(jnp.float32)
            err = float(jnp.linalg.norm(out - ref) / jnp.linalg.norm(ref))
            row["rel_err"] = err
            if not np.isfinite(err) or err > 2e-2:
                row["error"] = f"validation failed: rel err {err:.3g}"
            else:
                us = time_fn(call, qs, args, iters, repeats) * 1e6
                row.update(us=us, kv_tbps=kv_bytes / (us * 1e-6) / 1e12)
                row["frac_of_copy"] = row["kv_tbps"] / ceiling
        except Exception as e:  # noqa: BLE001 - one failing implementation must not stop the sweep
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        rows.append(row)
    return rows


def parse_args():
    """The command line (see the module docstring)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64, 256])
    ap.add_argument("--contexts", type=int, nargs="+", default=[512, 2048, 8192, 32768])
    ap.add_argument("--page-sizes", type=int, nargs="+", default=[16, 64])
    ap.add_argument(
        "--variants", nargs="+", default=[v for v in registry.DECODE if v != "reference"]
    )
    ap.add_argument(
        "--max-kv-gib", type=float, default=24.0, help="skip configs whose KV exceeds this"
    )
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default="benchmarks/h200.jsonl")
    ap.add_argument("--png", default="benchmarks/paged_attention.png")
    return ap.parse_args()


def sweep(args, ceiling, meta):
    """Every (page size, batch, context) configuration within ``--max-kv-gib``: its rows, each
    printed as a one-line JSON summary as its configuration finishes."""
    rows = []
    for ps in args.page_sizes:
        fns = impls(args.variants, ps)
        for B in args.batches:
            for ctx in args.contexts:
                if 2 * B * ctx * K * H * 2 > args.max_kv_gib * 2**30:
                    continue
                rows += run_config(B, ctx, ps, fns, ceiling, args.iters, args.repeats, meta)
                for r in rows[-len(fns) :]:
                    print(
                        json.dumps(
                            {
                                k: r.get(k)
                                for k in (
                                    "variant",
                                    "B",
                                    "context",
                                    "page_size",
                                    "us",
                                    "kv_tbps",
                                    "rel_err",
                                    "error",
                                )
                            }
                        )
                    )
    return rows


def write_rows(rows, path, out_dir):
    """Append one JSON line per row to ``path``; with ``out_dir`` ($OUT) also write them to
    ``out_dir/paged_attention.jsonl``."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "a") as fh:
        for r in rows:
            fh.write(json.dumps(r) + "\n")
    if out_dir:
        with open(os.path.join(out_dir, "paged_attention.jsonl"), "w") as fh:
            for r in rows:
                fh.write(json.dumps(r) + "\n")


def draw(plt, args, rows, ceiling, meta, out_dir):
    """KV read TB/s against context, one panel per page size, one line per (variant, batch),
    saved to ``--png`` (and a copy in ``out_dir``)."""
    fig, axes = plt.subplots(
        1, len(args.page_sizes), figsize=(7 * len(args.page_sizes), 5), squeeze=False
    )
    for ax, ps in zip(axes[0], args.page_sizes):
        for name in sorted({r["variant"] for r in rows}):
            for B in args.batches:
                pts = [
                    (r["context"], r["kv_tbps"])
                    for r in rows
                    if r["variant"] == name
                    and r["B"] == B
                    and r["page_size"] == ps
                    and "kv_tbps" in r
                ]
                if pts:
                    x, y = zip(*sorted(pts))
                    ax.plot(x, y, marker="o", label=f"{name} B={B}")
        ax.axhline(ceiling, color="k", ls="--", label="copy ceiling")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context")
        ax.set_ylabel("KV read TB/s")
        ax.set_title(f"paged decode attention, page {ps}, {meta['device']}")
        ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(args.png, dpi=120)
    if out_dir:
        fig.savefig(os.path.join(out_dir, os.path.basename(args.png)), dpi=120)


def plot(args, rows, ceiling, meta, out_dir):
    """`draw` with matplotlib's Agg backend; prints a note instead when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        draw(plt, args, rows, ceiling, meta, out_dir)
    except ImportError:
        print("matplotlib not installed: no PNG")


def print_table(rows):
    """The final table: one line per row, "-" where a row has no timing."""
    print(
        f"\n{'variant':<12} {'B':>4} {'ctx':>6} {'page':>4} {'us':>9} {'TB/s':>6} {'frac':>5}  note"
    )
    for r in rows:
        note = r.get("error", "")
        us = f"{r['us']:.1f}" if "us" in r else "-"
        tb = f"{r['kv_tbps']:.2f}" if "kv_tbps" in r else "-"
        fr = f"{r['frac_of_copy']:.2f}" if "frac_of_copy" in r else "-"
        print(
            f"{r['variant']:<12} {r['B']:>4} {r['context']:>6} {r['page_size']:>4} {us:>9} "
            f"{tb:>6} {fr:>5}  {note[:60]}"
        )


def main() -> None:
    args = parse_args()
    ceil = copy_ceiling_tbps()
    ceiling = max(ceil.values())
    commit = git_commit()
    meta = dict(
        jax=jax.__version__,
        device=jax.devices()[0].device_kind,
        date=datetime.date.today().isoformat(),
        commit=commit,
        copy_tbps=ceiling,
        copy_ceilings=ceil,
    )
    print(f"copy ceilings (TB/s): {ceil}; using {ceiling:.2f}")
    rows = sweep(args, ceiling, meta)
    out_dir = os.environ.get("OUT")
    write_rows(rows, args.out, out_dir)
    plot(args, rows, ceiling, meta, out_dir)
    print_table(rows)


if __name__ == "__main__":
    main()
