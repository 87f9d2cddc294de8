"""The engine's decode step on a synthetic batch, as the decode benchmarks run it
(bench_decode.py, profile_decode_step.py, probes): the Qwen3-8B architecture (`QWEN3_8B`), a
greedy decode `HostBatch` of B rows at one context (`host_batch`, `step_inputs`), runners over
the engine's jit step (`decode_runner`, `step_runner`), timings (`time_steps`,
`dispatch_times`), the engine's kernel and GEMM choices (`resolve_kernels`, `engine_gemm`,
`knob_error`, `parse_knobs`) and a check against the reference kernels
(`check_against_reference`)."""

from __future__ import annotations

import dataclasses
import functools
import inspect
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
from jaxinfer.runner.sampling import SamplingMetadata  # noqa: E402
from jaxinfer.runner.step import PACKED_STEPS, StepExecutor, StepInput  # noqa: E402
from jaxinfer.step_input import FIELDS, ShapeKey, allocate, pack  # noqa: E402
from pallas_kernels.paged_attention import registry  # noqa: E402
from scripts.step_tools import make_step_fn  # noqa: E402

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
