"""The engine's decode step on a synthetic batch, as the decode benchmarks run it
(bench_decode.py, profile_decode_step.py, probes): the Qwen3-8B architecture (`QWEN3_8B`), a
greedy decode `HostBatch` of B rows at one context (`decode_sizes`, `host_batch`), a runner over
the engine's two jitted programs, the forward (`FORWARD_STEPS`, `ForwardKey(B, decode=True)`)
then the sampler (`SAMPLE_STEP`, `SamplerKey(B, "greedy")`) (`decode_runner`, `step_runner`),
timings (`time_steps`, `dispatch_times`), the engine's kernel and GEMM choices
(`resolve_kernels`, `engine_gemm`, `knob_error`, `parse_knobs`) and a check of the forward
against the reference kernels (`check_against_reference`).

The step's inputs are one packed int32 buffer per program (`jaxinfer.step_input.pack`), so the
former unpacked input modes ("fixed", "fresh": a `StepInput` of device arrays) are gone:
`INPUT_MODES` is "packed" (the engine's way: both buffers packed and sent every step) and
"device" (both sent once and reused: the step without any host-to-device transfer)."""

from __future__ import annotations

import dataclasses
import inspect
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from jaxinfer.config import EngineConfig, KernelConfig, ModelConfig, resolve  # noqa: E402
from jaxinfer.models.kernels import ModelKernels, model_kernels  # noqa: E402
from jaxinfer.models.kv_cache import KVCache  # noqa: E402
from jaxinfer.runner.executor import FORWARD_STEPS, SAMPLE_STEP, StepExecutor  # noqa: E402
from jaxinfer.runner.step import forward_step  # noqa: E402
from jaxinfer.stats import EngineStats  # noqa: E402
from jaxinfer.step_input import (  # noqa: E402
    ForwardKey,
    HostBatch,
    SamplerKey,
    Sizes,
    StepShape,
    allocate,
    pack,
)
from pallas_kernels.paged_attention import registry  # noqa: E402

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
INPUT_MODES = ("packed", "device")
STATIC = ("key", "sizes", "cfg", "kernels")
_FORWARD = jax.jit(forward_step, static_argnames=STATIC)  # no donation: the check reuses its KV


def decode_sizes(cfg: ModelConfig, B: int, ctx: int, page_size: int) -> Sizes:
    """The step's `Sizes` for B rows at context ``ctx``: M = ceil(ctx / page_size) pages per row
    (the engine's M is ceil(max_model_len / page_size)), ``max_rows`` B."""
    M = -(-ctx // page_size)
    return Sizes(M, M * page_size, -(-cfg.vocab_size // 32), B)


def decode_shape(B: int) -> StepShape:
    """A greedy decode step of B rows: `ForwardKey(B, True)` and `SamplerKey(B, "greedy")`."""
    return StepShape(ForwardKey(B, True), SamplerKey(B, "greedy"))


def host_batch(
    sizes: Sizes, B: int, ctx: int, page_size: int, scatter_pages: bool = False, vocab: int = 1000
) -> HostBatch:
    """The engine's `HostBatch` (`jaxinfer.step_input`) of a greedy decode step of B rows at
    context ``ctx`` (row b: row b of the forward, a random token below min(1000, ``vocab``) at
    position ``ctx - 1``): row b holds pages
    ``1 + b * pages ...`` in order, or, with ``scatter_pages``, a random permutation of the same
    pages (as a free list hands them out after many allocations and frees)."""
    hb = allocate(decode_shape(B), sizes)
    a = hb.arrays
    pages = -(-ctx // page_size)
    ids = 1 + np.arange(B * pages, dtype=np.int32)
    if scatter_pages:
        ids = 1 + np.random.default_rng(1).permutation(B * pages).astype(np.int32)
    a["block_tables"][:, :pages] = ids.reshape(B, pages)
    last = ctx - 1
    a["positions"][:] = last
    a["slot_mapping"][:] = (
        a["block_tables"][np.arange(B), last // page_size] * page_size + last % page_size
    )
    a["tokens"][:] = np.random.default_rng(0).integers(0, min(1000, vocab), B)
    a["query_start_loc"][:] = np.arange(B + 1)
    a["seq_lens"][:] = ctx
    a["logits_indices"][:, 0] = np.arange(B)
    a["seeds"][:] = np.arange(B)
    hb.sample_rows[:] = True
    return hb


def kv_pool(k, v) -> KVCache:
    """A `KVCache` over pools ``k``, ``v`` with the placeholder tables the forward takes (its
    rows' tables and lengths come in its packed buffer)."""
    return KVCache(k, v, jnp.zeros((1, 1), jnp.int32), jnp.zeros((1,), jnp.int32))


def _compile(cfg, kernels, gemm, hb: HostBatch, args) -> tuple:
    """(forward, sampler) executables of ``hb``'s step, as `StepExecutor` compiles them:
    the forward on ``args`` (params, kv, buffer, prev tokens) with GEMM back-end ``gemm``."""
    key, sizes = hb.shape, hb.sizes
    fwd = FORWARD_STEPS[gemm].lower(*args, key=key.forward, sizes=sizes, cfg=cfg, kernels=kernels)
    logits = jax.ShapeDtypeStruct((key.sampler.rows, cfg.vocab_size), jnp.float32)
    smp = SAMPLE_STEP.lower(
        logits, jax.device_put(pack(hb, "sampling")), key=key.sampler, sizes=sizes, num_logprobs=0
    )
    return fwd.compile(), smp.compile()


def decode_runner(
    cfg, params, kernels, gemm, B, ctx, page_size, scatter_pages=False, inputs="packed"
):
    """(run, kv): ``run(kv) -> (tokens i32[B], kv)`` is one greedy decode step of B rows at
    context ``ctx`` (`host_batch`), the engine's forward (GEMM back-end ``gemm``, KV donated)
    then its sampler, both compiled on the first call, over a bf16 pool of exactly the pages the
    rows use (plus the null page). ``inputs`` (`INPUT_MODES`): "packed": both programs' buffers
    packed and sent every step (the engine's way); "device": sent once and reused."""
    if inputs not in INPUT_MODES:
        raise ValueError(f"inputs={inputs!r}: allowed {INPUT_MODES}")
    sizes = decode_sizes(cfg, B, ctx, page_size)
    hb = host_batch(sizes, B, ctx, page_size, scatter_pages, cfg.vocab_size)
    shape = (cfg.num_layers, B * sizes.pages + 1, cfg.num_kv_heads, page_size, cfg.head_dim)
    kv = kv_pool(*(jnp.full(shape, 0.01, jnp.bfloat16) for _ in "kv"))
    prev, exes, groups = jnp.zeros((B,), jnp.int32), [], ("forward", "sampling")
    sent = [jax.device_put(pack(hb, g)) for g in groups]

    def run(kv):
        fbuf, sbuf = sent if inputs == "device" else [jax.device_put(pack(hb, g)) for g in groups]
        if not exes:
            exes.extend(_compile(cfg, kernels, gemm, hb, (params, kv, fbuf, prev)))
        (logits, _), kv = exes[0](params, kv, fbuf, prev)
        return exes[1](logits, sbuf), kv

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
    """The GEMM back-end (`GEMM_COMPILER_OPTIONS`) the engine compiles the forward of a decode
    step of B rows with (`StepExecutor.gemm`: cuBLAS from ``kc.cublas_decode_min_batch`` rows,
    else XLA's)."""
    ex = StepExecutor(None, ModelKernels(), kc, Sizes(1, 1, 1, 1), 0, EngineStats())
    return ex.gemm(ForwardKey(B, True))


NOT_KNOBS = {
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


def knob_error(kc: KernelConfig, knobs: set) -> str | None:
    """Why the decode-kernel tuning keywords ``knobs`` do not fit ``kc.decode_attention`` (the
    reference has none; a kernel takes the keyword arguments of its signature), or None."""
    name = kc.decode_attention
    allowed = (
        set()
        if name == "reference"
        else set(inspect.signature(registry.get(name)).parameters) - NOT_KNOBS
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
    """The logits of one decode step's forward (`forward_step`, `host_batch`'s inputs) with the
    kernels of ``kc`` against the reference kernels (`ModelKernels()`: jnp attention, XLA
    fusions) on the same random KV pool, through the first ``layers`` layers of the model (two
    compiles of a short model, not of the timed one): returns the relative L2 error. Raises
    AssertionError when it is above ``tol``."""
    cfg = dataclasses.replace(cfg, num_layers=min(layers, cfg.num_layers))
    params = dict(params, layers={str(i): params["layers"][str(i)] for i in range(cfg.num_layers)})
    sizes = decode_sizes(cfg, B, ctx, page_size)
    hb = host_batch(sizes, B, ctx, page_size, vocab=cfg.vocab_size)
    shape = (cfg.num_layers, B * sizes.pages + 1, cfg.num_kv_heads, page_size, cfg.head_dim)
    kv = kv_pool(*(jax.random.normal(jax.random.key(i), shape, jnp.bfloat16) for i in (1, 2)))
    buf, prev = jnp.asarray(pack(hb, "forward")), jnp.zeros((B,), jnp.int32)

    def logits(kernels):
        static = dict(key=hb.shape.forward, sizes=sizes, cfg=cfg, kernels=kernels)
        (out, _), _ = _FORWARD(params, kv, buf, prev, **static)
        return np.asarray(out, np.float64)

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
    """`decode_runner` over the engine's programs with the kernels of ``kc`` (`model_kernels`,
    decode ``knobs``) and GEMM back-end ``gemm`` ("engine": `engine_gemm`). Returns (run, kv,
    the back-end used)."""
    kernels = model_kernels(kc, knobs or None)
    backend = engine_gemm(kc, B) if gemm == "engine" else gemm
    run, kv = decode_runner(cfg, params, kernels, backend, B, ctx, page_size, scatter_pages, inputs)
    return run, kv, backend
