"""Paged prefill attention benchmark: the Pallas triton prefill kernel (and, with ``--mosaic``,
the Mosaic GPU one, `prefill_mosaic`) against the reference.

The reference is the gather + dense float32 softmax path the engine runs today; Qwen3-8B heads
(N=32, K=8, H=128), bf16, on a GPU (``--interpret``: a float32 smoke run on the CPU, no file
written).

Each configuration is R rows of a Tq-token chunk that continues a cached prefix of ``--prefix``
tokens (causal over prefix + chunk). Every kernel setting is validated against the float32
reference first (relative error < 1e-2), then timed (median of ``--repeats`` of a jitted loop of
``--iters`` calls). Prints us per call, causal attention TFLOP/s and the speedup over the
reference; appends JSON objects (bench="paged_prefill") to ``--out``.

    python scripts/bench_paged_prefill.py [--rows 8 16] [--chunks 512 1024] [--prefix 0 1024]
        [--mosaic 64,2 128,2]
    python scripts/bench_paged_prefill.py --interpret --rows 2 --chunks 32 --prefix 16  # CPU smoke
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pallas_kernels.paged_attention import prefill_mosaic, prefill_triton, reference  # noqa: E402
from scripts.run_info import git_commit  # noqa: E402

N, K, H = 32, 8, 128


def make_inputs(R, Tq, prefix, page_size, dtype, seed=0):
    rng = np.random.default_rng(seed)
    S = prefix + Tq
    M = -(-S // page_size)
    P = R * M + 1
    tables = (1 + rng.permutation(R * M)).reshape(R, M).astype(np.int32)
    pos = np.broadcast_to(np.arange(prefix, S, dtype=np.int32), (R, Tq)).copy()
    q = jnp.asarray(rng.standard_normal((R, Tq, N, H)), dtype)
    kp = jnp.asarray(rng.standard_normal((1, P, K, page_size, H)), dtype)
    vp = jnp.asarray(rng.standard_normal((1, P, K, page_size, H)), dtype)
    return q, kp, vp, jnp.asarray(tables), jnp.full((R,), S, jnp.int32), jnp.asarray(pos)


def time_fn(fn, args, iters, repeats):
    def loop(*args):
        def body(i, acc):
            return acc + fn(*args)[0, 0, 0, 0].astype(jnp.float32)

        return jax.lax.fori_loop(0, iters, body, jnp.float32(0))

    f = jax.jit(loop)
    f(*args).block_until_ready()
    ts = []
    for _ in range(repeats):
        t = time.perf_counter()
        f(*args).block_until_ready()
        ts.append((time.perf_counter() - t) / iters)
    return float(np.median(ts))


def knob(spec: str, names: str = "block_q,pages_per_block,num_warps,num_stages") -> tuple:
    """A ``--knobs`` (or, ``names`` given, ``--mosaic``) entry: comma-separated integers, one
    for each of ``names``."""
    try:
        vals = tuple(int(x) for x in spec.split(","))
    except ValueError:
        vals = ()
    if len(vals) != len(names.split(",")):
        raise argparse.ArgumentTypeError(
            f"{spec!r}: expected {len(names.split(','))} integers {names}"
        )
    return vals


def parse_args():
    """The command line (see the module docstring); exits with a usage error on a non-GPU backend
    without ``--interpret``."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[4, 8, 16])
    ap.add_argument("--chunks", type=int, nargs="+", default=[512, 1024, 2048])
    ap.add_argument("--prefix", type=int, nargs="+", default=[0, 2048])
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument(
        "--knobs",
        nargs="*",
        type=knob,
        default=[(16, 4, 4, 2), (32, 4, 8, 2), (32, 8, 8, 3), (16, 8, 4, 3)],
        help="triton settings block_q,pages_per_block,num_warps,num_stages",
    )
    ap.add_argument(
        "--mosaic",
        nargs="*",
        type=functools.partial(knob, names="block_kv,num_stages"),
        default=[],
        help="Mosaic GPU kernel settings block_kv,num_stages to time too (Hopper)",
    )
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=16384, help="skip R * Tq above this")
    ap.add_argument("--interpret", action="store_true", help="CPU smoke run (float32)")
    ap.add_argument("--out", default="benchmarks/h200.jsonl")
    args = ap.parse_args()
    if not args.interpret and jax.default_backend() != "gpu":
        ap.error(
            f"JAX's backend is {jax.default_backend()!r}: the kernel compiles for a GPU only; "
            "use --interpret for a CPU smoke run"
        )
    return args


def variant_fns(knobs, kw, interpret, mosaic=()):
    """name -> attention call: the reference, one triton call per knob setting, then one Mosaic
    GPU call per ``mosaic`` (block_kv, num_stages) setting."""
    fns = {"reference": functools.partial(reference.paged_attention, **kw)}
    for bq, ppb, nw, ns in knobs:
        fns[f"triton[{bq},{ppb},{nw},{ns}]"] = functools.partial(
            prefill_triton.paged_prefill_attention,
            **kw,
            interpret=interpret,
            block_q=bq,
            pages_per_block=ppb,
            num_warps=nw,
            num_stages=ns,
        )
    for bk, ns in mosaic:
        fns[f"mosaic[{bk},{ns}]"] = functools.partial(
            prefill_mosaic.paged_prefill_attention,
            **kw,
            interpret=interpret,
            block_kv=bk,
            num_stages=ns,
        )
    return fns


def run_config(R, Tq, prefix, args, dtype, meta):
    """One (R, Tq, prefix) configuration: each variant validated against the float32 reference
    and timed; its rows, in variant order, each printed as it finishes (an error line for a
    failing variant, a JSON summary otherwise)."""
    inp = make_inputs(R, Tq, prefix, args.page_size, dtype)
    kw = dict(layer=0, scale=H**-0.5)
    with jax.default_matmul_precision("highest"):
        ref = reference.paged_attention(
            *[a.astype(jnp.float32) if a.dtype == dtype else a for a in inp], **kw
        )
    # causal pairs (query, visible key), 2 matmuls of 2*H flops each per head
    pairs = R * (Tq * prefix + Tq * (Tq + 1) // 2)
    flops = 4 * pairs * N * H
    rows, base = [], None
    for name, fn in variant_fns(args.knobs, kw, args.interpret, args.mosaic).items():
        row = dict(meta, variant=name, R=R, Tq=Tq, prefix=prefix)
        try:
            out = jax.jit(fn)(*inp).astype(jnp.float32)
            rel = float(jnp.linalg.norm(out - ref) / jnp.linalg.norm(ref))
            if not rel < 1e-2:
                raise AssertionError(f"relative error {rel:.2e} >= 1e-2")
            dt = time_fn(fn, inp, args.iters, args.repeats)
        except Exception as e:  # noqa: BLE001 (a failing setting is reported, not fatal)
            row.update(error=f"{type(e).__name__}: {str(e).splitlines()[0][:160]}")
            print(f"R={R} Tq={Tq} prefix={prefix} {name}: {row['error']}", flush=True)
            rows.append(row)
            continue
        base = dt if name == "reference" else base
        row.update(
            us=dt * 1e6,
            tflops=flops / dt / 1e12,
            rel_err=rel,
            speedup_vs_reference=(base / dt) if base else None,
        )
        rows.append(row)
        print(
            json.dumps(
                {k: row[k] for k in ("R", "Tq", "prefix", "variant", "us", "tflops", "rel_err")}
            ),
            flush=True,
        )
    return rows


def write_rows(rows, args):
    """Append the rows as JSON lines to ``--out`` (not with ``--interpret``); with $OUT set,
    also write them to ``$OUT/paged_prefill.jsonl``."""
    if not args.interpret:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "a") as fh:
            for r in rows:
                fh.write(json.dumps(r) + "\n")
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "paged_prefill.jsonl"), "w") as fh:
            for r in rows:
                fh.write(json.dumps(r) + "\n")


def print_table(rows):
    """The final table: timing, TFLOP/s and speedup per row, or the row's error."""
    print(
        f"\n{'R':>3} {'Tq':>5} {'prefix':>6} {'variant':<22} {'us':>10} {'TFLOP/s':>8} {'x ref':>6}"
    )
    for r in rows:
        if "us" in r:
            x = r["speedup_vs_reference"]
            print(
                f"{r['R']:>3} {r['Tq']:>5} {r['prefix']:>6} {r['variant']:<22} {r['us']:>10.1f} "
                f"{r['tflops']:>8.1f} {x if x is None else f'{x:.2f}':>6}"
            )
        else:
            print(f"{r['R']:>3} {r['Tq']:>5} {r['prefix']:>6} {r['variant']:<22} {r['error']}")


def main() -> None:
    args = parse_args()
    dtype = jnp.float32 if args.interpret else jnp.bfloat16
    commit = git_commit()
    meta = dict(
        bench="paged_prefill",
        jax=jax.__version__,
        device=jax.devices()[0].device_kind,
        date=datetime.date.today().isoformat(),
        commit=commit,
        N=N,
        K=K,
        H=H,
        page_size=args.page_size,
        dtype=jnp.dtype(dtype).name,
    )
    rows = []
    for prefix in args.prefix:
        for R in args.rows:
            for Tq in args.chunks:
                if R * Tq > args.max_tokens:
                    continue
                rows += run_config(R, Tq, prefix, args, dtype, meta)
    write_rows(rows, args)
    print_table(rows)


if __name__ == "__main__":
    main()
