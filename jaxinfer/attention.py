"""The one dispatch point for paged attention.

`make_attention_fn(name)` returns a callable with the signature of
`pallas_kernels.paged_attention.reference.paged_attention`:

    attn(q [B, T, N, H], k_pool [L, P, K, page_size, H], v_pool, block_tables i32[B, M],
         seq_lens i32[B], q_positions i32[B, T], *, layer, scale) -> [B, T, N, H]

Decode steps (T == 1, query at position ``seq_len - 1``) go to the named decode kernel; prefill
(T > 1) to the named prefill variant (`registry.prefill_names`). For decode, "auto" is the
reference on CPU (and for float32 engines) and the fastest validated variant on GPU
(`DEFAULT_GPU_VARIANT`); for prefill, "auto" is the ``triton`` flash-attention kernel on GPU
(`DEFAULT_GPU_PREFILL`; 5-7x faster than the reference on the H200, BENCHMARKS.md) and the
reference on CPU.

The model calls ``attn`` once per layer (L times in one jit, ``layer`` a Python int); each kernel
call sits behind an inner ``jax.jit`` that takes ``layer`` as a traced i32[], so all L calls share
one trace and one lowering of the kernel.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp

from pallas_kernels.paged_attention import reference, registry

# The fastest variant validated on the H200 (see BENCHMARKS.md). Its compiled form takes bf16/f16
# KV only (Hopper wgmma has no f32 P.V), so float32 engines fall back to the reference.
DEFAULT_GPU_VARIANT = "mosaic"
# Prefill: the Pallas flash-attention kernel (GPU tests pass in bf16 and f32; BENCHMARKS.md).
DEFAULT_GPU_PREFILL = "triton"


def resolve_backend(name: str, platform: str | None = None, dtype: str = "bfloat16") -> str:
    """Map "auto" to a concrete variant for ``platform`` (default: JAX's default backend) and the
    engine's compute ``dtype``.

    Raises:
        ValueError: ``name`` is neither "auto" nor a registered variant.
    """
    if name == "auto":
        platform = platform or jax.default_backend()
        if platform == "gpu" and dtype in ("bfloat16", "float16"):
            return DEFAULT_GPU_VARIANT
        return "reference"
    registry.get(name)  # raises ValueError listing the registered names
    platform = platform or jax.default_backend()
    if name != "reference" and platform != "gpu":
        raise ValueError(f"attention={name!r} is a GPU kernel and this host's JAX backend is "
                         f"{platform!r}; use 'auto' or 'reference' here (the kernels' CPU tests run "
                         "them in interpret mode)")
    return name


def resolve_prefill_backend(name: str, platform: str | None = None) -> str:
    """Map "auto" to a concrete prefill variant for ``platform``.

    Raises:
        ValueError: ``name`` is not "auto" or a registered prefill variant, or names a GPU kernel
            while JAX's backend is not a GPU.
    """
    if name == "auto":
        return DEFAULT_GPU_PREFILL if (platform or jax.default_backend()) == "gpu" else "reference"
    registry.get_prefill(name)  # raises ValueError listing the registered names
    platform = platform or jax.default_backend()
    if name != "reference" and platform != "gpu":
        raise ValueError(f"prefill_attention={name!r} is a GPU kernel and this host's JAX backend "
                         f"is {platform!r}; use 'auto' or 'reference' here (the kernel's CPU tests "
                         "run it in interpret mode)")
    return name


QKV_PROLOGUES = ("xla", "triton")
ADD_RMS_NORMS = ("xla", "triton")


def _fused_kernel(option: str, name, load: Callable) -> Callable | None:
    """A fused model kernel by name: "xla" -> None (the model's jnp ops), "triton" -> ``load()``
    (GPU only), a callable -> itself. Raises ValueError naming ``option``."""
    if callable(name):
        return name
    if name not in ("xla", "triton"):
        raise ValueError(f"{option}={name!r} is not one of ('xla', 'triton')")
    if name == "xla":
        return None
    if jax.default_backend() != "gpu":
        raise ValueError(f"{option}={name!r} is a GPU kernel and this host's JAX backend is "
                         f"{jax.default_backend()!r}; use 'xla' here")
    return load()


def qkv_prologue_fn(name) -> Callable | None:
    """The attention prologue of every step (q/k norm + RoPE + K/V page write) by name: "xla"
    (None: the model's jnp ops, fused by XLA) or "triton" (one Pallas kernel per layer,
    `pallas_kernels.qkv_prologue.triton_pallas`); a callable is returned as given (tests pass the
    kernel in interpret mode).

    Raises:
        ValueError: an unknown name, or "triton" while JAX's backend is not a GPU.
    """
    def load():
        from pallas_kernels.qkv_prologue import triton_pallas
        return triton_pallas.qkv_prologue

    return _fused_kernel("qkv_prologue", name, load)


def add_rms_norm_fn(name) -> Callable | None:
    """The residual add + RMSNorm at each sub-block boundary by name: "xla" (None: the model's
    jnp ops, fused by XLA) or "triton" (one Pallas kernel per boundary,
    `pallas_kernels.add_rms_norm.triton_pallas`; the hidden size must be a power of 2); a
    callable is returned as given (tests pass the kernel in interpret mode).

    Raises:
        ValueError: an unknown name, or "triton" while JAX's backend is not a GPU.
    """
    def load():
        from pallas_kernels.add_rms_norm import triton_pallas
        return triton_pallas.add_rms_norm

    return _fused_kernel("add_rms_norm", name, load)


def make_attention_fn(name: str, prefill: str = "reference",
                      decode_knobs: dict | None = None, qkv_prologue="xla",
                      add_rms_norm="xla") -> Callable:
    """Attention callable for the model from the decode variant ``name`` and the prefill variant
    ``prefill`` (both already resolved); ``decode_knobs`` are tuning keywords for the decode
    variant (e.g. ``{"num_splits": 4}`` for "mosaic"; its docstring lists them). The callable
    also carries the model's optional fused kernels as attributes: with a ``qkv_prologue``
    kernel (`qkv_prologue_fn`) the model runs every step's q/k norm + RoPE + K/V write through
    it (decode and packed prefill); with an ``add_rms_norm`` kernel (`add_rms_norm_fn`) every
    residual add + RMSNorm. With a prologue kernel and the "mosaic" decode variant it also has
    ``q_group_multiple`` (8): in decode steps the prologue then writes q grouped by KV head and
    zero-padded, [B, 1, K, Gp, H], and the callable takes it with ``num_heads=N``.

    Raises:
        ValueError: ``decode_knobs`` given for the reference decode path; a bad ``qkv_prologue``
            or ``add_rms_norm``.
    """
    if decode_knobs and name == "reference":
        raise ValueError(f"decode_knobs={decode_knobs} need a decode kernel variant; the "
                         "reference has no knobs")
    prologue = qkv_prologue_fn(qkv_prologue)
    add_norm = add_rms_norm_fn(add_rms_norm)
    if prologue is not None or add_norm is not None:
        inner = make_attention_fn(name, prefill, decode_knobs)

        def attn_with_kernels(*args, **kwargs):
            return inner(*args, **kwargs)

        if prologue is not None:
            attn_with_kernels.qkv_prologue = prologue
            if name == "mosaic":  # the prologue writes q grouped and padded as the kernel reads it
                from pallas_kernels.paged_attention.mosaic import Q_GROUP_MULTIPLE
                attn_with_kernels.q_group_multiple = Q_GROUP_MULTIPLE
        if add_norm is not None:
            attn_with_kernels.add_rms_norm = add_norm
        return attn_with_kernels
    if name == "reference" and prefill == "reference":
        return reference.paged_attention
    decode = None if name == "reference" else registry.get(name)
    if decode_knobs:
        decode = functools.partial(decode, **decode_knobs)
    prefill_fn = registry.get_prefill(prefill)

    # The mosaic kernel takes its layer as a page-offset array (`mosaic.layer_offsets`): made here
    # from the model's Python-int layer, it is a constant, so it costs no launch per layer.
    page_offsets = None
    if name == "mosaic":
        from pallas_kernels.paged_attention.mosaic import layer_offsets as page_offsets

    @functools.partial(jax.jit, static_argnames=("scale", "soft_cap", "sliding_window",
                                                 "num_heads"))
    def decode_step(q, k_pool, v_pool, block_tables, seq_lens, layer, page_offset, *, scale,
                    soft_cap, sliding_window, num_heads):
        """q [B, 1, N, H] (or grouped [B, 1, K, Gp, H] with ``num_heads``), layer i32[] (traced:
        one lowering serves every layer) -> [B, 1, N, H]."""
        extra = {} if num_heads is None else {"num_heads": num_heads}
        if page_offset is not None:
            extra["page_offset"] = page_offset
        out = decode(q[:, 0], k_pool, v_pool, block_tables, seq_lens, layer=layer, scale=scale,
                     soft_cap=soft_cap, sliding_window=sliding_window, **extra)
        return out[:, None]

    @functools.partial(jax.jit, static_argnames=("scale", "soft_cap", "sliding_window"))
    def prefill_step(q, k_pool, v_pool, block_tables, seq_lens, q_positions, layer, *, scale,
                     soft_cap, sliding_window):
        """q [B, T, N, H], layer i32[] (traced: one lowering serves every layer) -> [B, T, N, H]."""
        return prefill_fn(q, k_pool, v_pool, block_tables, seq_lens, q_positions, layer=layer,
                          scale=scale, soft_cap=soft_cap, sliding_window=sliding_window)

    def attn(q, k_pool, v_pool, block_tables, seq_lens, q_positions, *, layer, scale,
             soft_cap=None, sliding_window=None, num_heads=None):
        static = dict(scale=float(scale), soft_cap=None if soft_cap is None else float(soft_cap),
                      sliding_window=None if sliding_window is None else int(sliding_window))
        if q.ndim == 5 and (q.shape[1] != 1 or decode is None):
            raise ValueError(f"a grouped q {q.shape} is for the decode kernel only")
        if q.shape[1] == 1 and decode is not None:
            offset = None if page_offsets is None else page_offsets(layer, k_pool.shape[1])
            return decode_step(q, k_pool, v_pool, block_tables, seq_lens,
                               jnp.asarray(layer, jnp.int32), offset, num_heads=num_heads,
                               **static)
        if q.shape[1] == 1 or prefill == "reference":
            return reference.paged_attention(q, k_pool, v_pool, block_tables, seq_lens,
                                             q_positions, layer=layer, scale=scale,
                                             soft_cap=soft_cap, sliding_window=sliding_window)
        return prefill_step(q, k_pool, v_pool, block_tables, seq_lens, q_positions,
                            jnp.asarray(layer, jnp.int32), **static)

    return attn
