"""Qwen3 (dense): Llama blocks plus a per-head RMSNorm of q and k before RoPE.

Source: Qwen Team 2025, "Qwen3 Technical Report" (QK-Norm replaces Qwen2's QKV bias); HF
``modeling_qwen3.py`` (``q_norm``/``k_norm`` over the head dim, applied before ``apply_rotary_pos_emb``).
"""

from __future__ import annotations

from typing import Callable

import jax

from jaxinfer.config import ModelConfig
from jaxinfer.kv_cache import KVCache
from jaxinfer.models import common
from pallas_kernels.paged_attention import reference


class Qwen3Attention(common.Attention):
    """`common.Attention` with per-head RMSNorm of q [B, T, N, H] and k [B, T, K, H] (weights
    ``q_norm`` [H] and ``k_norm`` [H], shared across heads)."""

    def normalize_qk(self, q: jax.Array, k: jax.Array) -> tuple[jax.Array, jax.Array]:
        eps, pd = self.cfg.rms_norm_eps, self.param_dtype
        q = common._shared(self, common.RMSNorm("q_norm", eps, pd, name="q_norm_block"))(q)
        k = common._shared(self, common.RMSNorm("k_norm", eps, pd, name="k_norm_block"))(k)
        return q, k


class Qwen3ForCausalLM(common.CausalLM):
    """Qwen3 trunk: the Llama trunk with `Qwen3Attention`."""

    attention_cls = Qwen3Attention


def _check_arch(cfg: ModelConfig) -> None:
    if cfg.architecture != "qwen3":
        raise ValueError(f"cfg.architecture={cfg.architecture!r} passed to the qwen3 model; "
                         "allowed: 'qwen3' (use jaxinfer.models.registry to dispatch)")


def forward(params: dict, cfg: ModelConfig, tokens: jax.Array, positions: jax.Array,
            slot_mapping: jax.Array, kv: KVCache, *,
            attn_fn: Callable = reference.paged_attention) -> tuple[jax.Array, KVCache]:
    """Qwen3 forward over the paged cache; see `jaxinfer.models.registry.forward`."""
    _check_arch(cfg)
    return common.forward_with(Qwen3ForCausalLM, params, cfg, tokens, positions, slot_mapping,
                               kv, attn_fn=attn_fn)


def init_params(cfg: ModelConfig, key: jax.Array, dtype) -> dict:
    """Random Qwen3 params (HF-like init); see `jaxinfer.models.registry.init_params`."""
    _check_arch(cfg)
    return common.init_with(Qwen3ForCausalLM, cfg, key, dtype, reference.paged_attention)


compute_logits = common.compute_logits
