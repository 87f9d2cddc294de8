"""The jit entry point: one engine step (a packed prefill batch or a decode batch).

Nothing else in jaxinfer is jitted. The step is a pure function
``(params, kv, inputs) -> (next_tokens i32[Bmax], kv')`` with the KV cache donated, compiled once
per `jaxinfer.step_input.ShapeKey` (the shape bucket and sampling mode) and GEMM back-end.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import Callable

import jax
import jax.numpy as jnp

from jaxinfer import models
from jaxinfer.config import ModelConfig
from jaxinfer.kernels import ModelKernels
from jaxinfer.kv_cache import KVCache
from jaxinfer.sampling import SamplingMetadata, sample
from jaxinfer.step_input import ShapeKey, layout


@dataclass(frozen=True)
class StepInput:
    """Per-step device inputs, padded to a bucket (fields and padding: `jaxinfer.step_input`).

    Unpacked (decode; ``packing`` None): row b is sequence b; tokens, positions and
    slot_mapping are i32[B, T]; ``logits_indices`` i32[B] is the token of each row sampled.
    Packed (prefill; ``packing`` a `models.Packing`): tokens, positions and slot_mapping are
    i32[1, Tp], R sequences' chunks back to back; ``logits_indices`` i32[R] are packed indices.
    ``sampling``: `SamplingMetadata` for the B (R) rows.

    Asynchronous scheduling (both None when unused):
    prev_tokens:     i32[Bmax] the previous step's output, still on the device (zeros before the
                     first step); Bmax is the largest batch bucket, so its shape never varies
    pending_src:     i32[B] for each row, the row of ``prev_tokens`` that is its input token
                     (unpacked steps only), or -1: that row's ``tokens[b, 0]`` is used as given
    """

    tokens: jax.Array
    positions: jax.Array
    slot_mapping: jax.Array
    logits_indices: jax.Array
    sampling: SamplingMetadata
    packing: models.Packing | None = None
    prev_tokens: jax.Array | None = None
    pending_src: jax.Array | None = None


jax.tree_util.register_dataclass(
    StepInput, data_fields=[f.name for f in dataclasses.fields(StepInput)], meta_fields=[])


def step(params: dict, kv: KVCache, inp: StepInput, *, cfg: ModelConfig, kernels: ModelKernels,
         all_greedy: bool) -> tuple[jax.Array, KVCache]:
    """Model forward over this step's tokens, KV write, logits of one token per row, sampling.

    ``kv``'s ``block_tables`` i32[B, M] and ``seq_lens`` i32[B] describe this step; ``cfg``,
    ``kernels``, ``all_greedy`` are static. Returns (next token ids i32[B] (i32[R] packed), the
    updated cache); with ``inp.prev_tokens`` the ids are zero-padded to its length Bmax, so the
    next step's input has a fixed shape.
    """
    tokens = inp.tokens
    if inp.prev_tokens is not None and inp.packing is None:
        tokens = merge_pending_tokens(tokens, inp.prev_tokens, inp.pending_src)
    hidden, kv = models.forward(params, cfg, tokens, inp.positions, inp.slot_mapping, kv,
                                kernels=kernels, packing=inp.packing)
    with jax.named_scope("lm_head"):
        if inp.packing is None:
            last = jnp.take_along_axis(hidden, inp.logits_indices[:, None, None], axis=1)[:, 0]
        else:
            last = hidden[0][inp.logits_indices]                                # [R, D]
        logits = models.compute_logits(params, cfg, last)
    with jax.named_scope("sample"):
        tokens = sample(logits, inp.sampling, all_greedy=all_greedy)
    if inp.prev_tokens is not None:
        tokens = jnp.zeros_like(inp.prev_tokens).at[:tokens.shape[0]].set(tokens)
    return tokens, kv


# XLA options per GEMM back-end: "xla" lets XLA pick (its autotuned Triton GEMM fusions, cuBLAS
# as a fallback); "cublas" turns the Triton GEMM emitter off, so every matmul is a cuBLAS call.
GEMM_COMPILER_OPTIONS = {"xla": None, "cublas": {"xla_gpu_enable_triton_gemm": False}}


def _jit(fn: Callable, gemm: str, static: tuple[str, ...]) -> Callable:
    if gemm not in GEMM_COMPILER_OPTIONS:
        raise ValueError(f"gemm={gemm!r} is invalid: allowed {sorted(GEMM_COMPILER_OPTIONS)}")
    return jax.jit(fn, donate_argnums=(1,), compiler_options=GEMM_COMPILER_OPTIONS[gemm],
                   static_argnames=static)


def make_step_fn(cfg: ModelConfig, kernels: ModelKernels, all_greedy: bool,
                 gemm: str = "xla") -> Callable:
    """``jax.jit`` of `step` for one sampling mode (KV cache donated), compiled with the GEMM
    back-end ``gemm`` (a key of `GEMM_COMPILER_OPTIONS`); for benchmarks of the bare step.

    Raises:
        ValueError: unknown ``gemm``.
    """
    return _jit(functools.partial(step, cfg=cfg, kernels=kernels, all_greedy=all_greedy), gemm, ())


def unpack(buf: jax.Array, key: ShapeKey) -> tuple[jax.Array, jax.Array, StepInput]:
    """The inverse of `jaxinfer.step_input.pack` inside the jit (``key`` static): returns
    (block_tables i32[B, M], seq_lens i32[B], `StepInput` without ``prev_tokens``)."""
    groups: dict[str, dict] = {"input": {}, "kv": {}, "sampling": {}, "packing": {}}
    off = 0
    for f, shape in layout(key):
        n = math.prod(shape)
        x = buf[off:off + n].reshape(shape)
        if jnp.dtype(f.dtype) != jnp.int32:
            x = jax.lax.bitcast_convert_type(x, jnp.dtype(f.dtype))
        groups[f.group][f.name] = x
        off += n
    packing = models.Packing(**groups["packing"]) if key.packed else None
    inp = StepInput(**groups["input"], sampling=SamplingMetadata(**groups["sampling"]),
                    packing=packing)
    return groups["kv"]["block_tables"], groups["kv"]["seq_lens"], inp


def packed_step(params: dict, kv: KVCache, buf: jax.Array, prev_tokens: jax.Array, *,
                key: ShapeKey, cfg: ModelConfig,
                kernels: ModelKernels) -> tuple[jax.Array, KVCache]:
    """`step` on inputs packed into one buffer ``buf`` i32[S] (`jaxinfer.step_input.pack`;
    ``key``, static, gives its layout and the sampling mode): one transfer a step.

    ``kv``'s ``block_tables``/``seq_lens`` are fixed-shape placeholders passed through unchanged
    (this step's come from ``buf``), so the compiled signature depends on the bucket only through
    ``buf``. ``prev_tokens`` i32[Bmax]: the previous step's output. Returns (token ids
    i32[Bmax], the updated cache).
    """
    tables, lens, inp = unpack(buf, key)
    inp = dataclasses.replace(inp, prev_tokens=prev_tokens)
    tokens, new = step(params, kv.replace(block_tables=tables, seq_lens=lens), inp, cfg=cfg,
                       kernels=kernels, all_greedy=key.all_greedy)
    return tokens, new.replace(block_tables=kv.block_tables, seq_lens=kv.seq_lens)


def merge_pending_tokens(tokens: jax.Array, prev_tokens: jax.Array, src: jax.Array) -> jax.Array:
    """i32[B, T] ``tokens`` with ``tokens[i, 0] = prev_tokens[src[i]]`` where ``src[i] >= 0``:
    the input tokens still on the device (asynchronous scheduling), filled inside the step."""
    picked = prev_tokens[jnp.maximum(src, 0)]
    return tokens.at[:, 0].set(jnp.where(src >= 0, picked, tokens[:, 0]))


# The engine's jit entry points, one per GEMM back-end: call as ``PACKED_STEPS[gemm](params, kv,
# buf, prev_tokens, key=, cfg=, kernels=)`` (all three static, hashable: engines of equal model
# and kernels share compiled steps); ``.lower(...).compile()`` gives the ahead-of-time form.
PACKED_STEPS = {gemm: _jit(packed_step, gemm, ("key", "cfg", "kernels"))
                for gemm in GEMM_COMPILER_OPTIONS}
