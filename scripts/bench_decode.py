"""Decode-step benchmark on the GPU: the engine's jit step (model + paged attention + sampling) on the
Qwen3-8B architecture with random bf16 weights, over batch x context.

Bytes per step = weight bytes read (embedding gather excluded) + KV bytes read (B x context x KV
bytes per token). Reports ms/step, tok/s and achieved bandwidth as a fraction of the best
device-to-device copy measured in the same run; marks the knee of the throughput curve (the last
batch whose tok/s gain over the previous batch is >= 1.5x its batch ratio / 2). Appends JSON objects
(bench="decode") to ``benchmarks/h200.jsonl`` and draws ``benchmarks/decode.png``.

    python scripts/bench_decode.py [--layers 36] [--batches 1 8 32 64 128 256] [--contexts 1024 4096]
        [--attention reference|triton|mosaic|...] [--model DIR]
"""

from __future__ import annotations

import argparse
import datetime
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

from scripts.run_info import git_commit, xla_flags  # noqa: E402

from jaxinfer.attention import (ADD_RMS_NORMS, QKV_PROLOGUES, make_attention_fn,  # noqa: E402
                                resolve_backend)
from pallas_kernels.paged_attention import registry  # noqa: E402
from jaxinfer.config import ModelConfig  # noqa: E402
from jaxinfer.kv_cache import KVCache  # noqa: E402
from jaxinfer.models import registry as models  # noqa: E402
from jaxinfer.models.params import param_bytes  # noqa: E402
from jaxinfer.sampling import SamplingMetadata  # noqa: E402
from jaxinfer.engine.batch_builder import HostBatch, pack_device_inputs  # noqa: E402
from jaxinfer.step import (GEMM_COMPILER_OPTIONS, StepInput, make_packed_step_fn,  # noqa: E402
                           make_step_fn)

QWEN3_8B = dict(architecture="qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                num_layers=36, num_heads=32, num_kv_heads=8, head_dim=128, rope_theta=1e6,
                max_position_embeddings=40960, tie_word_embeddings=False, rms_norm_eps=1e-6)


def step_inputs(B, ctx, page_size, M, scatter_pages=False):
    """Step inputs of B rows at context ``ctx``: row b holds pages ``1 + b * pages ...`` in order,
    or, with ``scatter_pages``, a random permutation of the same pages (as a free list hands
    them out after many allocations and frees)."""
    tables = np.zeros((B, M), np.int32)
    pages = -(-(ctx) // page_size)
    ids = 1 + np.arange(B * pages, dtype=np.int32)
    if scatter_pages:
        ids = 1 + np.random.default_rng(1).permutation(B * pages).astype(np.int32)
    tables[:, :pages] = ids.reshape(B, pages)
    pos = np.full((B, 1), ctx - 1, np.int32)
    slots = tables[np.arange(B), (ctx - 1) // page_size][:, None] * page_size + (ctx - 1) % page_size
    sm = SamplingMetadata(
        temperature=np.zeros(B, np.float32), top_k=np.zeros(B, np.int32), top_p=np.ones(B, np.float32),
        min_p=np.zeros(B, np.float32), repetition_penalty=np.ones(B, np.float32),
        seeds=np.arange(B, dtype=np.uint32), step_idx=np.zeros(B, np.int32),
        penalty_tokens=np.zeros((B, 0), np.int32))
    inp = StepInput(tokens=np.random.default_rng(0).integers(0, 1000, (B, 1)).astype(np.int32),
                    positions=pos, slot_mapping=slots.astype(np.int32),
                    logits_indices=np.zeros(B, np.int32), sampling=sm)
    # tables and lens stay on the host: the step donates the whole KVCache (tables included), so each
    # step gets fresh copies, as the engine's host loop does.
    return jax.tree_util.tree_map(jnp.asarray, inp), tables, np.full((B,), ctx, np.int32)


INPUT_MODES = ("fixed", "fresh", "packed", "device")


def decode_runner(cfg, params, step_fn, B, ctx, page_size, scatter_pages=False, inputs="fixed"):
    """(run, kv): ``run(kv) -> (tokens, kv)`` is one decode step of B rows at context ``ctx``
    over a bf16 pool of exactly the pages they use (plus the null page); see `step_inputs`.

    ``inputs``, how the step's inputs reach the device each step: "fixed": they stay the same
    device buffers (only the tables and lengths are sent again); "fresh": every input array is
    sent again with ``jnp.asarray``, as the engine did before 989f578; "packed": one int32
    buffer (`pack_device_inputs`), as the engine does now; "device": nothing is sent (the tables
    and lengths too stay device buffers: the step's time without any host-to-device transfer);
    ``step_fn`` must come from `make_packed_step_fn` for "packed", else from `make_step_fn`."""
    if inputs not in INPUT_MODES:
        raise ValueError(f"inputs={inputs!r}: allowed {INPUT_MODES}")
    M = -(-ctx // page_size)
    shape = (cfg.num_layers, B * M + 1, cfg.num_kv_heads, page_size, cfg.head_dim)
    kv = KVCache(k=jnp.zeros(shape, jnp.bfloat16) + 0.01, v=jnp.zeros(shape, jnp.bfloat16) + 0.01,
                 block_tables=jnp.zeros((B, M), jnp.int32), seq_lens=jnp.zeros((B,), jnp.int32))
    inp, tables, lens = step_inputs(B, ctx, page_size, M, scatter_pages)
    host = jax.tree_util.tree_map(np.asarray, inp)
    if inputs == "packed":
        sm = host.sampling
        hb = HostBatch(host.tokens, host.positions, host.slot_mapping, host.logits_indices, tables,
                       lens, sm.temperature, sm.top_k, sm.top_p, sm.min_p, sm.repetition_penalty,
                       sm.seeds, sm.step_idx, sm.penalty_tokens, np.ones(B, bool),
                       np.zeros(B, bool), True)
        prev = jnp.zeros((B,), jnp.int32)
        kv = kv.replace(block_tables=jnp.zeros((1, 1), jnp.int32),
                        seq_lens=jnp.zeros((1,), jnp.int32))

        def run(kv):
            buf, layout = pack_device_inputs(hb)
            return step_fn(params, kv, jax.device_put(buf), prev, layout=layout)
        return run, kv

    if inputs == "device":  # the step passes the tables and lengths through to its output
        return (lambda kv: step_fn(params, kv, inp)), kv.replace(
            block_tables=jnp.asarray(tables), seq_lens=jnp.asarray(lens))

    def run(kv):
        step_inp = inp if inputs == "fixed" else jax.tree_util.tree_map(jnp.asarray, host)
        return step_fn(params, kv.replace(block_tables=jnp.asarray(tables),
                                          seq_lens=jnp.asarray(lens)), step_inp)
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
    return (row["gemm"], row["inputs"], row["decode_knobs"], row["qkv_prologue"],
            row.get("add_rms_norm", "xla"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64, 128, 256])
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--attention", default="auto")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--gemm", nargs="+", default=["xla"], choices=sorted(GEMM_COMPILER_OPTIONS),
                    help="GEMM back-ends to compare side by side (jaxinfer.step.make_step_fn)")
    ap.add_argument("--scatter-pages", action="store_true",
                    help="each row's pages in random order across the pool (as after many "
                         "allocations), instead of contiguous")
    ap.add_argument("--inputs", nargs="+", default=["packed"], choices=INPUT_MODES,
                    help="how step inputs reach the device each step, compared side by side "
                         "(decode_runner); packed is the engine's way")
    ap.add_argument("--decode-knobs", nargs="+", default=[""], metavar="K=V[,K=V]",
                    help="tuning keywords of the decode kernel, one set per argument, compared "
                         "side by side (e.g. num_splits=1 num_splits=4 for mosaic); '' = defaults")
    ap.add_argument("--qkv-prologue", nargs="+", default=["xla"], choices=QKV_PROLOGUES,
                    help="attention prologue (q/k norm + RoPE + K/V write) of each layer, compared "
                         "side by side: XLA's fusions or one Pallas kernel (jaxinfer.attention."
                         "qkv_prologue_fn)")
    ap.add_argument("--add-rms-norm", nargs="+", default=["xla"], choices=ADD_RMS_NORMS,
                    help="residual add + RMSNorm (two per layer), compared side by side: XLA's "
                         "fusions or one Pallas kernel each (jaxinfer.attention.add_rms_norm_fn)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--max-kv-gib", type=float, default=100.0)
    ap.add_argument("--out", default="benchmarks/h200.jsonl")
    ap.add_argument("--png", default="benchmarks/decode.png")
    args = ap.parse_args()
    try:
        knob_sets = {k: parse_knobs(k) for k in args.decode_knobs}
    except ValueError as e:
        ap.error(str(e))
    attn_name = resolve_backend(args.attention, dtype="bfloat16")
    knob_names = {n for knobs in knob_sets.values() for n in knobs}
    if knob_names:
        allowed = (set() if attn_name == "reference" else
                   set(inspect.signature(registry.get(attn_name)).parameters) - {
                       "q", "k_pool", "v_pool", "block_tables", "seq_lens", "layer", "scale",
                       "soft_cap", "sliding_window", "interpret"})
        if knob_names - allowed:
            ap.error(f"--decode-knobs {sorted(knob_names - allowed)} are not knobs of attention "
                     f"{attn_name!r}; its knobs: {sorted(allowed) or 'none'}")

    from bench_paged_attention import copy_ceiling_tbps  # same directory
    ceil = copy_ceiling_tbps()
    ceiling = max(ceil.values())
    cfg = ModelConfig(**dict(QWEN3_8B, num_layers=args.layers))
    params = models.init_params(cfg, jax.random.key(0), jnp.bfloat16)
    wbytes = param_bytes(cfg, 2) - cfg.vocab_size * cfg.hidden_size * 2  # embedding is gathered
    attns = {(k, pro, an): make_attention_fn(attn_name, decode_knobs=knobs or None,
                                             qkv_prologue=pro, add_rms_norm=an)
             for k, knobs in knob_sets.items() for pro in args.qkv_prologue
             for an in args.add_rms_norm}
    # the variants compared side by side at every (context, B); a row's variant: `variant_of`
    variants = list(itertools.product(args.gemm, args.inputs, args.decode_knobs, args.qkv_prologue,
                                      args.add_rms_norm))
    kv_tok = cfg.kv_bytes_per_token(2)
    commit = git_commit()
    meta = dict(bench="decode", variant=attn_name, jax=jax.__version__, device=jax.devices()[0].device_kind,
                date=datetime.date.today().isoformat(), commit=commit, xla_flags=xla_flags(),
                layers=args.layers,
                copy_tbps=ceiling, page_size=args.page_size, scatter_pages=args.scatter_pages)
    print(f"copy ceilings {ceil}; weights read/step {wbytes / 1e9:.2f} GB; attention={attn_name}")
    rows = []
    for ctx, B, (gemm, inputs, knobs, pro, an) in itertools.product(args.contexts, args.batches,
                                                                    variants):
        kv_gib = B * ctx * kv_tok / 2**30
        if kv_gib > args.max_kv_gib:
            print(f"skip B={B} ctx={ctx}: KV {kv_gib:.1f} GiB")
            continue
        make = make_packed_step_fn if inputs == "packed" else make_step_fn
        run, kv = decode_runner(cfg, params, make(cfg, attns[(knobs, pro, an)], True, gemm), B, ctx,
                                args.page_size, args.scatter_pages, inputs)
        t = time.perf_counter()
        toks, kv = run(kv)  # compile
        toks.block_until_ready()
        compile_s = time.perf_counter() - t
        dt, kv = time_steps(run, kv, args.steps)
        disp, alone, kv = dispatch_times(run, kv)
        moved = wbytes + B * ctx * kv_tok
        row = dict(meta, B=B, context=ctx, gemm=gemm, inputs=inputs, decode_knobs=knobs,
                   qkv_prologue=pro, add_rms_norm=an,
                   ms_per_step=dt * 1e3,
                   tok_s=B / dt,
                   dispatch_ms=disp * 1e3, isolated_step_ms=alone * 1e3, compile_s=compile_s,
                   bytes_per_step=moved, tbps=moved / dt / 1e12, frac_of_copy=moved / dt / 1e12 / ceiling)
        rows.append(row)
        print(json.dumps({k: row[k] for k in ("B", "context", "gemm", "inputs", "decode_knobs",
                                              "qkv_prologue", "add_rms_norm", "ms_per_step", "tok_s", "tbps",
                                              "frac_of_copy", "dispatch_ms", "compile_s")}))
        del kv
    for ctx, v in itertools.product(args.contexts, variants):
        rs = [r for r in rows if r["context"] == ctx and variant_of(r) == v]
        for a, b in zip(rs, rs[1:]):
            gain, ratio = b["tok_s"] / a["tok_s"], b["B"] / a["B"]
            if gain < 0.5 * ratio and not any(r.get("knee") for r in rs):
                a["knee"] = True
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "a") as fh:
        for r in rows:
            fh.write(json.dumps(r) + "\n")
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "decode.jsonl"), "w") as fh:
            for r in rows:
                fh.write(json.dumps(r) + "\n")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(7, 5))
        for ctx, (gemm, inputs, knobs, pro, an) in itertools.product(args.contexts, variants):
            sel = [r for r in rows
                   if r["context"] == ctx and variant_of(r) == (gemm, inputs, knobs, pro, an)]
            if sel:
                x, y = zip(*[(r["B"], r["tok_s"]) for r in sel])
                ax.plot(x, y, marker="o", label=f"context {ctx}, {gemm} GEMMs, {inputs} inputs"
                        + (f", {knobs}" if knobs else "")
                        + (f", {pro} prologue" if pro != "xla" else "")
                        + (f", {an} add+norm" if an != "xla" else ""))
                knee = [r for r in sel if r.get("knee")]
                for r in knee:
                    ax.annotate("knee", (r["B"], r["tok_s"]))
        ax.set_xscale("log", base=2); ax.set_xlabel("batch"); ax.set_ylabel("decode tok/s")
        ax.set_title(f"Qwen3-8B arch decode step, {meta['device']}, attention={attn_name}")
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.png, dpi=120)
        if os.environ.get("OUT"):
            fig.savefig(os.path.join(os.environ["OUT"], os.path.basename(args.png)), dpi=120)
    except ImportError:
        print("matplotlib not installed: no PNG")
    print("\ndispatch: host ms for one step's call to return with the device idle (launch cost)")
    print(f"\n{'B':>4} {'ctx':>5} {'gemm':>6} {'inputs':>6} {'ms/step':>8} {'tok/s':>8} "
          f"{'GB/step':>8} {'TB/s':>6} {'frac':>5} {'dispatch':>8} {'prologue':>8} {'add+norm':>8}  knobs")
    for r in rows:
        print(f"{r['B']:>4} {r['context']:>5} {r['gemm']:>6} {r['inputs']:>6} {r['ms_per_step']:>8.2f} "
              f"{r['tok_s']:>8.0f} "
              f"{r['bytes_per_step'] / 1e9:>8.2f} {r['tbps']:>6.2f} {r['frac_of_copy']:>5.2f} "
              f"{r['dispatch_ms']:>8.2f} {r['qkv_prologue']:>8} {r['add_rms_norm']:>8}  "
              f"{r['decode_knobs'] or '-'}"
              f"{'  <- knee' if r.get('knee') else ''}")


if __name__ == "__main__":
    main()
