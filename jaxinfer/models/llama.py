"""Llama (2/3/3.x, SmolLM2, ...): the shared blocks of `common` with plain attention.

Source: Touvron et al. 2023, "Llama 2"; Meta "The Llama 3 Herd of Models" (2024); HF
``modeling_llama.py`` (the numerics these functions are tested against).
"""

from __future__ import annotations

from typing import Callable

import jax

from jaxinfer.config import ModelConfig
from jaxinfer.kv_cache import KVCache
from jaxinfer.models import common
from pallas_kernels.paged_attention import reference

LlamaAttention = common.Attention


class LlamaForCausalLM(common.CausalLM):
    """Llama trunk: embed -> L x (RMSNorm, attention, RMSNorm, SwiGLU) -> final RMSNorm."""

    attention_cls = LlamaAttention


def _check_arch(cfg: ModelConfig) -> None:
    if cfg.architecture != "llama":
        raise ValueError(f"cfg.architecture={cfg.architecture!r} passed to the llama model; "
                         "allowed: 'llama' (use jaxinfer.models.registry to dispatch)")


def forward(params: dict, cfg: ModelConfig, tokens: jax.Array, positions: jax.Array,
            slot_mapping: jax.Array, kv: KVCache, *,
            attn_fn: Callable = reference.paged_attention) -> tuple[jax.Array, KVCache]:
    """Llama forward over the paged cache; see `jaxinfer.models.registry.forward`."""
    _check_arch(cfg)
    return common.forward_with(LlamaForCausalLM, params, cfg, tokens, positions, slot_mapping,
                               kv, attn_fn=attn_fn)


def init_params(cfg: ModelConfig, key: jax.Array, dtype) -> dict:
    """Random Llama params (HF-like init); see `jaxinfer.models.registry.init_params`."""
    _check_arch(cfg)
    return common.init_with(LlamaForCausalLM, cfg, key, dtype, reference.paged_attention)


compute_logits = common.compute_logits
