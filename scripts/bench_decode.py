"""Decode-step benchmark on the GPU: the engine's jit step (model + paged attention + sampling) on
the Qwen3-8B architecture with random bf16 (or fp8: ``--quantization``) weights, over batch x
context.

Bytes per step = weight bytes read (embedding gather excluded) + KV bytes read (B x context x KV
bytes per token). The kernels are the engine's: each ``--kernels`` spec is parsed with
`KernelConfig.parse` and resolved for this platform with `jaxinfer.config.resolve` (the default
"" is the engine's default), and with ``--gemm engine`` (the default) each batch compiles with the
GEMM back-end the engine picks for it (`StepExecutor.step_fn`: cuBLAS from
``cublas_decode_min_batch`` rows). Reports ms/step, tok/s and achieved bandwidth as a fraction of
the best device-to-device copy measured in the same run; marks the knee of the throughput curve
(the last batch whose tok/s gain over the previous batch is >= 1.5x its batch ratio / 2). Appends
JSON objects (bench="decode") to ``benchmarks/h200.jsonl`` and draws ``benchmarks/decode.png``.

    python scripts/bench_decode.py [--layers 36] [--batches 1 8 32 64 128 256]
        [--contexts 1024 4096] [--kernels SPEC [SPEC ...]] [--gemm engine|xla|cublas ...]
        [--decode-knobs K=V ...]
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import inspect
import itertools
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from jaxinfer import models  # noqa: E402
from jaxinfer.config import EngineConfig, KernelConfig, ModelConfig, resolve  # noqa: E402
from jaxinfer.models.kernels import ModelKernels, model_kernels  # noqa: E402
from jaxinfer.models.kv_cache import KVCache  # noqa: E402
from jaxinfer.models.quantize import quantize_params  # noqa: E402
from jaxinfer.runner.sampling import SamplingMetadata  # noqa: E402
from jaxinfer.runner.step import GEMM_COMPILER_OPTIONS, PACKED_STEPS, StepExecutor, StepInput  # noqa: E402
from jaxinfer.step_input import FIELDS, ShapeKey, allocate, pack  # noqa: E402
from pallas_kernels.paged_attention import registry  # noqa: E402
from scripts.run_info import git_commit, xla_flags  # noqa: E402
from scripts.step_tools import make_step_fn  # noqa: E402,F401

QWEN3_8B = dict(
    architecture="qwen3",
    vocab_size=151936,
    hidden_size=4096,
    intermediate_size=12288,
    num_layers=36,
    num_heads=32,
    num_kv_heads=8,
    head_dim=128,
    rope_theta=1e6,
    max_position_embeddings=40960,
    tie_word_embeddings=False,
    rms_norm_eps=1e-6,
)


def host_batch(B, ctx, page_size, M, scatter_pages=False):
    """The engine's `HostBatch` (`jaxinfer.step_input`) of a greedy decode step of B rows at
    context ``ctx``: row b holds pages ``1 + b * pages ...`` in order, or, with
    ``scatter_pages``, a random permutation of the same pages (as a free list hands them out
    after many allocations and frees)."""
    hb = allocate(ShapeKey(batch=B, tokens=1, pages=M, penalty=0, query=None, all_greedy=True))
    a = hb.arrays
    pages = -(-(ctx) // page_size)
    ids = 1 + np.arange(B * pages, dtype=np.int32)
    if scatter_pages:
        ids = 1 + np.random.default_rng(1).permutation(B * pages).astype(np.int32)
    a["block_tables"][:, :pages] = ids.reshape(B, pages)
    a["positions"][:] = ctx - 1
    a["slot_mapping"][:, 0] = (
        a["block_tables"][np.arange(B), (ctx - 1) // page_size] * page_size + (ctx - 1) % page_size
    )
    a["tokens"][:] = np.random.default_rng(0).integers(0, 1000, (B, 1))
    a["seq_lens"][:] = ctx
    a["seeds"][:] = np.arange(B)
    hb.sample_rows[:] = True
    return hb


def step_inputs(B, ctx, page_size, M, scatter_pages=False):
    """(`StepInput` on the device, block tables, lengths) of `host_batch`'s step. Tables and
    lengths stay on the host: the step donates the whole KVCache (tables included), so each step
    gets fresh copies, as the engine's host loop does."""
    hb = host_batch(B, ctx, page_size, M, scatter_pages)
    group = {
        g: {f.name: hb.arrays[f.name] for f in FIELDS if f.group == g and f.name in hb.arrays}
        for g in ("input", "sampling")
    }
    inp = StepInput(
        **{k: v for k, v in group["input"].items() if k != "pending_src"},
        sampling=SamplingMetadata(**group["sampling"]),
    )
    return jax.tree_util.tree_map(jnp.asarray, inp), hb.block_tables, hb.seq_lens


INPUT_MODES = ("fixed", "fresh", "packed", "device")


def decode_runner(cfg, params, step_fn, B, ctx, page_size, scatter_pages=False, inputs="fixed"):
    """(run, kv): ``run(kv) -> (tokens, kv)`` is one decode step of B rows at context ``ctx``
    over a bf16 pool of exactly the pages they use (plus the null page); see `step_inputs`.

    ``inputs``, how the step's inputs reach the device each step: "fixed": they stay the same
    device buffers (only the tables and lengths are sent again); "fresh": every input array is
    sent again with ``jnp.asarray``, as the engine did before 989f578; "packed": one int32
    buffer (`jaxinfer.step_input.pack`) into the engine's jit step; "device": nothing is sent
    (the tables and lengths too stay device buffers: the step's time without any host-to-device
    transfer). ``step_fn``: for "packed", ``PACKED_STEPS[gemm]`` with ``cfg`` and ``kernels``
    bound (`packed_runner_fn`), else from `make_step_fn`."""
    if inputs not in INPUT_MODES:
        raise ValueError(f"inputs={inputs!r}: allowed {INPUT_MODES}")
    M = -(-ctx // page_size)
    shape = (cfg.num_layers, B * M + 1, cfg.num_kv_heads, page_size, cfg.head_dim)
    kv = KVCache(
        k=jnp.zeros(shape, jnp.bfloat16) + 0.01,
        v=jnp.zeros(shape, jnp.bfloat16) + 0.01,
        block_tables=jnp.zeros((B, M), jnp.int32),
        seq_lens=jnp.zeros((B,), jnp.int32),
    )
    if inputs == "packed":
        hb = host_batch(B, ctx, page_size, M, scatter_pages)
        prev = jnp.zeros((B,), jnp.int32)
        kv = kv.replace(
            block_tables=jnp.zeros((1, 1), jnp.int32), seq_lens=jnp.zeros((1,), jnp.int32)
        )

        def run(kv):
            return step_fn(params, kv, jax.device_put(pack(hb)), prev, key=hb.key)

        return run, kv
    inp, tables, lens = step_inputs(B, ctx, page_size, M, scatter_pages)
    host = jax.tree_util.tree_map(np.asarray, inp)

    if inputs == "device":  # the step passes the tables and lengths through to its output
        return (lambda kv: step_fn(params, kv, inp)), kv.replace(
            block_tables=jnp.asarray(tables), seq_lens=jnp.asarray(lens)
        )

    def run(kv):
        step_inp = inp if inputs == "fixed" else jax.tree_util.tree_map(jnp.asarray, host)
        return step_fn(
            params,
            kv.replace(block_tables=jnp.asarray(tables), seq_lens=jnp.asarray(lens)),
            step_inp,
        )

    return run, kv


def time_steps(run, kv, steps: int, warmup: int = 3):
    """Mean seconds per step of ``steps`` back-to-back ``run(kv) -> (tokens, kv)`` calls after
    ``warmup`` untimed ones (one sync at each end, so dispatch overlaps the device).
    Returns (seconds per step, kv)."""
    for _ in range(warmup):
        toks, kv = run(kv)
    toks.block_until_ready()
    t = time.perf_counter()
    for _ in range(steps):
        toks, kv = run(kv)
    toks.block_until_ready()
    return (time.perf_counter() - t) / steps, kv


def parse_knobs(text: str) -> dict:
    """``"num_splits=4,block_kv=128"`` -> ``{"num_splits": 4, "block_kv": 128}`` (integer values;
    "" -> {}).

    Raises:
        ValueError: an item that is not ``name=integer``.
    """
    out = {}
    for item in filter(None, text.split(",")):
        name, sep, value = item.partition("=")
        if not sep or not name.isidentifier() or not value.lstrip("-").isdigit():
            raise ValueError(f"--decode-knobs item {item!r} is invalid: expected name=integer")
        out[name] = int(value)
    return out


def dispatch_times(run, kv, steps: int = 5):
    """Host seconds for ``run(kv)`` to return when the device is idle (the host's cost of
    launching one step: XLA enqueues every kernel from the calling thread), and seconds until
    that step's tokens are ready, each averaged over ``steps`` steps with a sync between them.
    A dispatch time close to the back-to-back step time means the step is launch-bound.
    Returns (dispatch seconds, isolated step seconds, kv)."""
    disp = total = 0.0
    for _ in range(steps):
        t = time.perf_counter()
        toks, kv = run(kv)
        t1 = time.perf_counter()
        toks.block_until_ready()
        disp += t1 - t
        total += time.perf_counter() - t
    return disp / steps, total / steps, kv


def variant_of(row: dict) -> tuple:
    """What a row compares side by side at one (context, B)."""
    return (
        row["gemm"],
        row["inputs"],
        row["decode_knobs"],
        row.get("kernels", ""),
        row.get("quantization", "none"),
    )


def resolve_kernels(
    cfg: ModelConfig, spec: str, platform: str | None = None, quantization: str = "none"
) -> KernelConfig:
    """The engine's resolved `KernelConfig` for ``spec`` (`KernelConfig.parse`; "" = the
    defaults) on ``platform`` (default: JAX's backend) in bfloat16 with ``quantization`` ("none"
    or "fp8" weights), by `jaxinfer.config.resolve`.
    Raises ValueError: a bad spec, or kernels the platform or the model's shapes do not take."""
    ec = EngineConfig(
        dtype="bfloat16",
        kernels=KernelConfig.parse(spec),
        quantization=None if quantization == "none" else quantization,
    )
    return resolve(cfg, ec, platform or jax.default_backend()).kernels


def engine_gemm(kc: KernelConfig, B: int) -> str:
    """The GEMM back-end the engine compiles a greedy decode step of B rows with
    (`StepExecutor.step_fn`: cuBLAS from ``kc.cublas_decode_min_batch`` rows, else XLA's)."""
    key = ShapeKey(batch=B, tokens=1, pages=1, penalty=0, query=None, all_greedy=True)
    fn = StepExecutor(None, ModelKernels(), kc, 1, None).step_fn(key)
    return next(g for g, f in PACKED_STEPS.items() if f is fn)


def knob_error(kc: KernelConfig, knobs: set) -> str | None:
    """Why the decode-kernel tuning keywords ``knobs`` do not fit ``kc.decode_attention`` (the
    reference has none; a kernel takes the keyword arguments of its signature), or None."""
    name = kc.decode_attention
    allowed = (
        set()
        if name == "reference"
        else set(inspect.signature(registry.get(name)).parameters)
        - {
            "q",
            "k_pool",
            "v_pool",
            "block_tables",
            "seq_lens",
            "layer",
            "scale",
            "soft_cap",
            "sliding_window",
            "interpret",
            "page_offset",
        }
    )
    if knobs - allowed:
        return (
            f"--decode-knobs {sorted(knobs - allowed)} are not knobs of decode attention "
            f"{name!r}; its knobs: {sorted(allowed) or 'none'}"
        )
    return None


def check_against_reference(
    cfg,
    params,
    kc,
    knobs: dict,
    B: int,
    ctx: int,
    page_size: int,
    tol: float = 0.05,
    layers: int = 2,
) -> float:
    """One decode step's logits with the kernels of ``kc`` against the reference kernels
    (`ModelKernels()`: jnp attention, XLA fusions) on the same random KV pool, through the first
    ``layers`` layers of the model (two compiles of a short model, not of the timed one): returns
    the relative L2 error. Raises AssertionError when it is above ``tol``."""
    cfg = dataclasses.replace(cfg, num_layers=min(layers, cfg.num_layers))
    params = dict(params, layers={str(i): params["layers"][str(i)] for i in range(cfg.num_layers)})
    M = -(-ctx // page_size)
    shape = (cfg.num_layers, B * M + 1, cfg.num_kv_heads, page_size, cfg.head_dim)
    k, v = (jax.random.normal(jax.random.key(i), shape, jnp.bfloat16) for i in (1, 2))
    inp, tables, lens = step_inputs(B, ctx, page_size, M)

    def logits(kernels):
        def f(params, kv):
            hidden, _ = models.forward(
                params, cfg, inp.tokens, inp.positions, inp.slot_mapping, kv, kernels=kernels
            )
            return models.compute_logits(params, cfg, hidden[:, 0])

        kv = KVCache(k=k, v=v, block_tables=jnp.asarray(tables), seq_lens=jnp.asarray(lens))
        return np.asarray(jax.jit(f)(params, kv), np.float64)

    want = logits(ModelKernels())
    err = float(
        np.linalg.norm(logits(model_kernels(kc, knobs or None)) - want) / np.linalg.norm(want)
    )
    assert err <= tol, f"kernels {kc} disagree with the reference: relative error {err:.3g}"
    return err


def step_runner(
    cfg,
    params,
    kc,
    knobs: dict,
    gemm: str,
    inputs: str,
    B: int,
    ctx: int,
    page_size: int,
    scatter_pages: bool,
):
    """`decode_runner` over the engine's step with the kernels of ``kc`` (`model_kernels`) and
    GEMM back-end ``gemm`` ("engine": `engine_gemm`). Returns (run, kv, the back-end used)."""
    kernels = model_kernels(kc, knobs or None)
    backend = engine_gemm(kc, B) if gemm == "engine" else gemm
    if inputs == "packed":
        fn = functools.partial(PACKED_STEPS[backend], cfg=cfg, kernels=kernels)
    else:
        fn = make_step_fn(cfg, kernels, True, backend)
    run, kv = decode_runner(cfg, params, fn, B, ctx, page_size, scatter_pages, inputs)
    return run, kv, backend


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64, 128, 256])
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument(
        "--kernels",
        nargs="+",
        default=[""],
        metavar="SPEC",
        help="kernel configs compared side by side, one KernelConfig.parse spec per "
        "argument, resolved for this platform as the engine does; '' = the "
        "engine's default. Keys: " + KernelConfig.help(),
    )
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument(
        "--gemm",
        nargs="+",
        default=["engine"],
        choices=["engine"] + sorted(GEMM_COMPILER_OPTIONS),
        help="GEMM back-ends compared side by side; engine (default): the engine's "
        "per-batch choice (cuBLAS from the spec's cublas_decode_min_batch rows)",
    )
    ap.add_argument(
        "--scatter-pages",
        action="store_true",
        help="each row's pages in random order across the pool (as after many "
        "allocations), instead of contiguous",
    )
    ap.add_argument(
        "--inputs",
        nargs="+",
        default=["packed"],
        choices=INPUT_MODES,
        help="how step inputs reach the device each step, compared side by side "
        "(decode_runner); packed is the engine's way",
    )
    ap.add_argument(
        "--decode-knobs",
        nargs="+",
        default=[""],
        metavar="K=V[,K=V]",
        help="tuning keywords of the decode kernel, one set per argument, compared "
        "side by side (e.g. num_splits=1 num_splits=4 for mosaic); '' = defaults",
    )
    ap.add_argument(
        "--no-check",
        action="store_true",
        help="skip the first check of each kernel config against the reference "
        "kernels (one decode step's logits, smallest batch and context)",
    )
    ap.add_argument(
        "--quantization",
        nargs="+",
        default=["none"],
        choices=["none", "fp8"],
        help="weights compared side by side: none (bf16), fp8 (the engine's "
        "quantization='fp8': e4m3, per-output-channel scales)",
    )
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--max-kv-gib", type=float, default=100.0)
    ap.add_argument("--out", default="benchmarks/h200.jsonl")
    ap.add_argument("--png", default="benchmarks/decode.png")
    args = ap.parse_args()
    cfg = ModelConfig(**dict(QWEN3_8B, num_layers=args.layers))
    # settings are checked before any device work: specs, the platform, knobs vs. the kernel
    try:
        knob_sets = {k: parse_knobs(k) for k in args.decode_knobs}
        kcs = {
            (spec, q): resolve_kernels(cfg, spec, quantization=q)
            for spec, q in itertools.product(args.kernels, args.quantization)
        }
    except ValueError as e:
        ap.error(str(e))
    knob_names = {n for knobs in knob_sets.values() for n in knobs}
    for err in filter(None, (knob_names and knob_error(kc, knob_names) for kc in kcs.values())):
        ap.error(err)

    from bench_paged_attention import copy_ceiling_tbps  # same directory

    ceiling = max((ceil := copy_ceiling_tbps()).values())
    base = models.init_params(cfg, jax.random.key(0), jnp.bfloat16)
    params = {q: base if q == "none" else quantize_params(base) for q in args.quantization}
    wbytes = {
        q: sum(x.nbytes for x in jax.tree_util.tree_leaves(p))  # the embedding: gathered
        - cfg.vocab_size * cfg.hidden_size * 2
        for q, p in params.items()
    }
    # the variants compared side by side at every (context, B); a row's variant: `variant_of`
    variants = list(
        itertools.product(
            args.gemm, args.inputs, args.decode_knobs, args.kernels, args.quantization
        )
    )
    kv_tok = cfg.kv_bytes_per_token(2)
    meta = dict(
        bench="decode",
        jax=jax.__version__,
        device=jax.devices()[0].device_kind,
        date=datetime.date.today().isoformat(),
        commit=git_commit(),
        xla_flags=xla_flags(),
        layers=args.layers,
        copy_tbps=ceiling,
        page_size=args.page_size,
        scatter_pages=args.scatter_pages,
    )
    print(
        f"copy ceilings {ceil}; weights read/step (GB) "
        + ", ".join(f"{q}: {b / 1e9:.2f}" for q, b in wbytes.items())
    )
    for (spec, q), kc in kcs.items():
        print(f"kernels {spec!r} -> {kc}, quantization {q}")
        for knobs in [] if args.no_check else args.decode_knobs:
            err = check_against_reference(
                cfg,
                params[q],
                kc,
                knob_sets[knobs],
                min(args.batches),
                min(args.contexts),
                args.page_size,
            )
            print(
                f"  {knobs or 'default knobs'}: logits vs the reference kernels, relative "
                f"error {err:.2e}",
                flush=True,
            )
    rows = []
    for ctx, B, (gemm, inputs, knobs, spec, q) in itertools.product(
        args.contexts, args.batches, variants
    ):
        if (kv_gib := B * ctx * kv_tok / 2**30) > args.max_kv_gib:
            print(f"skip B={B} ctx={ctx}: KV {kv_gib:.1f} GiB")
            continue
        kc = kcs[spec, q]
        run, kv, backend = step_runner(
            cfg,
            params[q],
            kc,
            knob_sets[knobs],
            gemm,
            inputs,
            B,
            ctx,
            args.page_size,
            args.scatter_pages,
        )
        t = time.perf_counter()
        toks, kv = run(kv)  # compile
        toks.block_until_ready()
        compile_s = time.perf_counter() - t
        dt, kv = time_steps(run, kv, args.steps)
        disp, alone, kv = dispatch_times(run, kv)
        moved = wbytes[q] + B * ctx * kv_tok
        row = dict(
            meta,
            B=B,
            context=ctx,
            gemm=gemm,
            gemm_backend=backend,
            inputs=inputs,
            decode_knobs=knobs,
            kernels=spec,
            quantization=q,
            variant=kc.decode_attention,
            cublas_decode_min_batch=kc.cublas_decode_min_batch,
            ms_per_step=dt * 1e3,
            tok_s=B / dt,
            dispatch_ms=disp * 1e3,
            isolated_step_ms=alone * 1e3,
            compile_s=compile_s,
            bytes_per_step=moved,
            tbps=moved / dt / 1e12,
            frac_of_copy=moved / dt / 1e12 / ceiling,
        )
        rows.append(row)
        print(
            json.dumps(
                {
                    k: row[k]
                    for k in (
                        "B",
                        "context",
                        "kernels",
                        "quantization",
                        "variant",
                        "gemm_backend",
                        "inputs",
                        "decode_knobs",
                        "ms_per_step",
                        "tok_s",
                        "tbps",
                        "frac_of_copy",
                        "dispatch_ms",
                        "compile_s",
                    )
                }
            )
        )
        del kv
    for ctx, v in itertools.product(args.contexts, variants):
        rs = [r for r in rows if r["context"] == ctx and variant_of(r) == v]
        for a, b in zip(rs, rs[1:]):
            if b["tok_s"] / a["tok_s"] < 0.5 * b["B"] / a["B"] and not any(
                r.get("knee") for r in rs
            ):
                a["knee"] = True
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    for path, mode in [(args.out, "a")] + (
        [(os.path.join(os.environ["OUT"], "decode.jsonl"), "w")] if os.environ.get("OUT") else []
    ):
        with open(path, mode) as fh:
            fh.writelines(json.dumps(r) + "\n" for r in rows)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 5))
        for ctx, (gemm, inputs, knobs, spec, q) in itertools.product(args.contexts, variants):
            sel = [
                r
                for r in rows
                if r["context"] == ctx and variant_of(r) == (gemm, inputs, knobs, spec, q)
            ]
            if sel:
                x, y = zip(*[(r["B"], r["tok_s"]) for r in sel])
                ax.plot(
                    x,
                    y,
                    marker="o",
                    label=f"context {ctx}, {gemm} GEMMs, {inputs} inputs"
                    + (f", {knobs}" if knobs else "")
                    + f", kernels {spec or 'default'} ({sel[0]['variant']})"
                    + ("" if q == "none" else f", {q} weights"),
                )
                for r in (r for r in sel if r.get("knee")):
                    ax.annotate("knee", (r["B"], r["tok_s"]))
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch")
        ax.set_ylabel("decode tok/s")
        ax.set_title(f"Qwen3-8B arch decode step, {meta['device']}")
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.png, dpi=120)
        if os.environ.get("OUT"):
            fig.savefig(os.path.join(os.environ["OUT"], os.path.basename(args.png)), dpi=120)
    except ImportError:
        print("matplotlib not installed: no PNG")
    print("\ndispatch: host ms for one step's call to return with the device idle (launch cost)")
    print(
        f"\n{'B':>4} {'ctx':>5} {'gemm':>6} {'inputs':>6} {'ms/step':>8} {'tok/s':>8} "
        f"{'GB/step':>8} {'TB/s':>6} {'frac':>5} {'dispatch':>8} {'weights':>7}  kernels / knobs"
    )
    for r in rows:
        print(
            f"{r['B']:>4} {r['context']:>5} {r['gemm_backend']:>6} {r['inputs']:>6} "
            f"{r['ms_per_step']:>8.2f} {r['tok_s']:>8.0f} {r['bytes_per_step'] / 1e9:>8.2f} "
            f"{r['tbps']:>6.2f} {r['frac_of_copy']:>5.2f} {r['dispatch_ms']:>8.2f} "
            f"{r['quantization'].replace('none', 'bf16'):>7}  {r['kernels'] or 'default'} "
            f"({r['variant']}) {r['decode_knobs'] or '-'}{'  <- knee' if r.get('knee') else ''}"
        )


if __name__ == "__main__":
    main()
