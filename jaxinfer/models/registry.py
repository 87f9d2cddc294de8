"""Model entry points by architecture: ``forward``, ``compute_logits``, ``init_params``.

Dispatches on ``cfg.architecture`` ("llama" | "qwen3") to `jaxinfer.models.llama` /
`jaxinfer.models.qwen3`. Nothing here is jitted: `jaxinfer.step` jits the step around these
(``cfg`` and ``attn_fn`` are static: ``cfg`` is a hashable frozen dataclass).
"""

from __future__ import annotations

import importlib
from typing import Callable

import jax

from jaxinfer.config import ModelConfig
from jaxinfer.kv_cache import KVCache
from jaxinfer.models import common
from pallas_kernels.paged_attention import reference

# architecture -> (module, Flax model class); the modules hold only what differs per family.
_MODELS = {"llama": ("jaxinfer.models.llama", "LlamaForCausalLM"),
           "qwen3": ("jaxinfer.models.qwen3", "Qwen3ForCausalLM")}


def architectures() -> tuple[str, ...]:
    """Supported ``cfg.architecture`` values."""
    return tuple(_MODELS)


def model_class(cfg: ModelConfig) -> type:
    """The Flax model class implementing ``cfg.architecture``.

    Raises:
        ValueError: an architecture with no implementation (lists the supported ones).
    """
    if cfg.architecture not in _MODELS:
        raise ValueError(f"cfg.architecture={cfg.architecture!r} has no model; "
                         f"supported: {architectures()}")
    module, name = _MODELS[cfg.architecture]
    return getattr(importlib.import_module(module), name)


def forward(params: dict, cfg: ModelConfig, tokens: jax.Array, positions: jax.Array,
            slot_mapping: jax.Array, kv: KVCache, *,
            attn_fn: Callable = reference.paged_attention,
            packing: common.Packing | None = None) -> tuple[jax.Array, KVCache]:
    """One model step over the paged KV cache (prefill, decode or mixed).

    Each layer: attn_norm -> fused q/k/v projection -> (Qwen3: q_norm/k_norm) -> RoPE at
    ``positions`` -> ``write_kv`` of this step's K/V into the pools via ``slot_mapping`` ->
    ``attn_fn`` -> wo -> residual -> mlp_norm -> SwiGLU (fused gate/up) -> residual. The L layers
    are unrolled (each reads its own weight arrays); the pools are threaded through them.

    Args:
        params: the plain param tree of `jaxinfer.models.params` (no ``{"params": ...}`` wrapper);
            its dtype is the compute dtype.
        cfg: the model config (static under jit).
        tokens: i32[B, T] token ids (padding: any valid id).
        positions: i32[B, T] absolute positions (RoPE and the causal mask).
        slot_mapping: i32[B, T] flat KV slot ``page * page_size + offset`` per token; padded tokens
            point into the null page 0.
        kv: `KVCache` with pools [L, P, K, page_size, H], block_tables i32[R, M], seq_lens i32[R]
            (the valid KV length of each sequence after this step's write); R = B unpacked.
        attn_fn: paged attention with the signature of
            ``pallas_kernels.paged_attention.reference.paged_attention`` (a plain Python callable,
            static under jit).
        packing: None (row b of tokens is sequence b), or a `common.Packing` for a packed prefill
            batch: tokens [1, Tp] hold R sequences' chunks back to back (no padding between them).
    Returns:
        (hidden [B, T, D] after the final norm in the compute dtype, the KVCache with updated pools).
    Raises:
        ValueError: unsupported architecture, or a param tree that does not match ``cfg``.
    """
    return common.forward_with(model_class(cfg), params, cfg, tokens, positions, slot_mapping, kv,
                               attn_fn=attn_fn, packing=packing)


def compute_logits(params: dict, cfg: ModelConfig, hidden: jax.Array) -> jax.Array:
    """f32[..., V] logits of ``hidden`` [..., D] via ``lm_head`` [D, V], or ``embed.T`` when tied.

    Raises:
        ValueError: untied ``cfg`` but no ``lm_head`` in ``params``.
    """
    return common.compute_logits(params, cfg, hidden)


def init_params(cfg: ModelConfig, key: jax.Array, dtype) -> dict:
    """Random params of the layout `param_shapes(cfg)` in ``dtype`` (for tests and benchmarks).

    Matrices and the embedding ~ N(0, 0.02) (HF ``initializer_range``), norm weights = 1.
    """
    return common.init_with(model_class(cfg), cfg, key, dtype, reference.paged_attention)
