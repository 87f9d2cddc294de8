"""Probe: does the layer loop read each weight once per decode step?

Times the weight-streaming core of a decode step at batch B (default 1) for Qwen3-8B shapes (q, k,
v, o, gate, up, down matmuls per layer; no attention) in five forms, and reports the effective
weight read bandwidth against the copy ceiling measured in the same run:

  scan      lax.scan over weights stacked on a leading L axis (jaxinfer.models' former layout)
  unrolled  a Python loop over a list of per-layer weight dicts (no slicing inside the step)
  fused     the unrolled form with q/k/v as one [D, (N + 2K) * H] matrix and gate/up as one
            [D, 2F] matrix (same total bytes, 4 GEMMs per layer instead of 7): the layout of
            jaxinfer.models (the fused wqkv and w_gate_up weights)
  scan+dsf  the scan form with XLA_FLAGS=--xla_gpu_enable_dynamic_slice_fusion=true (separate
            process, since XLA flags are read at start-up)
  fused+cublas  the fused form with XLA_FLAGS=--xla_gpu_enable_triton_gemm=false (cuBLAS GEMMs
            instead of XLA's Triton GEMM fusions)

If ``scan`` is ~3x slower than ``unrolled``, the scan copies each layer's weight slice before its
GEMM (read + write + read): issue 4's leading hypothesis for the 13 ms batch-1 step.

    python scripts/probes/probe_layer_scan.py [--layers 36] [--batch 1] [--dims 4096 12288 32 8 128]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time


def layer_fns(dims: list[int]):
    """``(layer, fused_layer)``: one decode layer's weight-streaming core for ``dims`` (D, F, N,
    K, H), over separate q/k/v and gate/up weights, and over fused ``wqkv`` and ``w_gate_up``."""
    import jax
    import jax.numpy as jnp

    D, F, N, K, H = dims

    def attend(x, q, k, v, w):
        a = q + jnp.tile(k + v, (1, N // K))  # stand-in for attention: uses q, k, v
        return x + a @ w["wo"]

    def layer(x, w):
        x = attend(x, x @ w["wq"], x @ w["wk"], x @ w["wv"], w)
        return x + (jax.nn.silu(x @ w["w_gate"]) * (x @ w["w_up"])) @ w["w_down"]

    def fused_layer(x, w):
        qkv = x @ w["wqkv"]
        x = attend(x, qkv[:, : N * H], qkv[:, N * H : (N + K) * H], qkv[:, (N + K) * H :], w)
        gu = x @ w["w_gate_up"]
        return x + (jax.nn.silu(gu[:, :F]) * gu[:, F:]) @ w["w_down"]

    return layer, fused_layer


def form_fn(form: str, stacked: dict, layers: int, dims: list[int]):
    """``(f, weights)``: the layer loop ``f(x, weights)`` in ``form`` (module docstring) and the
    weights it takes, built from ``stacked`` ([layers, ...] per name)."""
    import jax
    import jax.numpy as jnp

    layer, fused_layer = layer_fns(dims)
    if form in ("unrolled", "fused"):
        weights = [{n: v[i] for n, v in stacked.items()} for i in range(layers)]
        del stacked
        if form == "fused":
            weights = [
                {
                    "wqkv": jnp.concatenate([w["wq"], w["wk"], w["wv"]], axis=1),
                    "wo": w["wo"],
                    "w_gate_up": jnp.concatenate([w["w_gate"], w["w_up"]], axis=1),
                    "w_down": w["w_down"],
                }
                for w in weights
            ]
        body = fused_layer if form == "fused" else layer

        def f(x, ws):
            for w in ws:
                x = body(x, w)
            return x
    else:
        weights = stacked

        def f(x, ws):
            return jax.lax.scan(lambda h, w: (layer(h, w), None), x, ws)[0]

    return f, weights


def stacked_weights(key, layers: int, dims: list[int]) -> dict:
    """Random bf16 weights for ``dims`` (D, F, N, K, H): name -> [layers, ...]."""
    import jax
    import jax.numpy as jnp

    D, F, N, K, H = dims
    shapes = {
        "wq": (D, N * H),
        "wk": (D, K * H),
        "wv": (D, K * H),
        "wo": (N * H, D),
        "w_gate": (D, F),
        "w_up": (D, F),
        "w_down": (F, D),
    }
    return {
        n: (jax.random.normal(jax.random.fold_in(key, i), (layers, *s), jnp.bfloat16) * 0.02)
        for i, (n, s) in enumerate(shapes.items())
    }


def run(form: str, layers: int, batch: int, dims: list[int], iters: int) -> dict:
    """One form timed (median of 5 rounds of ``iters`` calls, after a warm-up): its row with ms
    per step, the weight GB (the same in every form) and the effective weight read TB/s."""
    import jax
    import jax.numpy as jnp

    key = jax.random.key(0)
    # no reference to the stacked weights kept here: form_fn frees them once sliced
    f, weights = form_fn(form, stacked_weights(key, layers, dims), layers, dims)
    nbytes = sum(v.size * 2 for v in jax.tree.leaves(weights))
    x = jax.random.normal(key, (batch, dims[0]), jnp.bfloat16)
    g = jax.jit(f)
    g(x, weights).block_until_ready()
    ts = []
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(iters):
            y = g(x, weights)
        y.block_until_ready()
        ts.append((time.perf_counter() - t) / iters)
    dt = sorted(ts)[len(ts) // 2]
    return dict(form=form, ms=dt * 1e3, weight_gb=nbytes / 1e9, tbps=nbytes / dt / 1e12)


def parse_args():
    """The command line (see the module docstring; ``--form``, hidden: run one form here)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument(
        "--dims",
        type=int,
        nargs=5,
        default=[4096, 12288, 32, 8, 128],
        metavar=("D", "F", "N", "K", "H"),
    )
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument(
        "--form", choices=["scan", "unrolled", "fused"], default=None, help=argparse.SUPPRESS
    )
    return ap.parse_args()


def run_forms(args) -> list[dict]:
    """Each of the five forms in a child process of this script (XLA flags are read at start-up):
    its row, or ``form`` and the tail of its stderr as ``error`` when it fails."""
    base = [
        sys.executable,
        os.path.abspath(__file__),
        "--layers",
        str(args.layers),
        "--batch",
        str(args.batch),
        "--iters",
        str(args.iters),
        "--dims",
        *map(str, args.dims),
    ]
    rows = []
    for form, extra in (
        ("scan", ""),
        ("unrolled", ""),
        ("fused", ""),
        ("scan", "--xla_gpu_enable_dynamic_slice_fusion=true"),
        ("fused", "--xla_gpu_enable_triton_gemm=false"),
    ):
        env = dict(os.environ)
        if extra:
            env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " " + extra).strip()
        r = subprocess.run(base + ["--form", form], capture_output=True, text=True, env=env)
        if r.returncode != 0:
            rows.append(
                dict(form=form + ("+" + extra if extra else ""), error=r.stderr.strip()[-300:])
            )
            continue
        row = json.loads(r.stdout.strip().splitlines()[-1])
        row["form"] = form + (
            "" if not extra else "+dsf" if "dynamic_slice" in extra else "+cublas"
        )
        rows.append(row)
    return rows


def main() -> None:
    args = parse_args()
    if args.form:  # child process: one form, JSON on the last line
        print(json.dumps(run(args.form, args.layers, args.batch, args.dims, args.iters)))
        return
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    rows = run_forms(args)
    from scripts.bench_paged_attention import copy_ceiling_tbps

    ceiling = max(copy_ceiling_tbps().values())
    print(
        f"\nweights {rows[0].get('weight_gb', 0):.2f} GB, batch {args.batch}, copy ceiling "
        f"{ceiling:.2f} TB/s"
    )
    print(f"{'form':<12} {'ms':>8} {'TB/s':>6} {'frac':>5}")
    for r in rows:
        if "error" in r:
            print(f"{r['form']:<12} error: {r['error']}")
        else:
            print(f"{r['form']:<12} {r['ms']:>8.2f} {r['tbps']:>6.2f} {r['tbps'] / ceiling:>5.2f}")


if __name__ == "__main__":
    main()
