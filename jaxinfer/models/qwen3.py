"""Qwen3 (dense): Llama blocks plus a per-head RMSNorm of q and k before RoPE.

Source: Qwen Team 2025, "Qwen3 Technical Report" (QK-Norm replaces Qwen2's QKV bias); HF
``modeling_qwen3.py`` (``q_norm``/``k_norm`` over the head dim, applied before ``apply_rotary_pos_emb``).
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxinfer.models import common


class Qwen3Attention(common.Attention):
    """`common.Attention` with per-head RMSNorm of the query heads (weight ``q_norm`` [H]) and the
    key heads (weight ``k_norm`` [H]), each weight shared across its heads; both run as one
    RMSNorm over qk [B, T, N + K, H] with the weights broadcast to [N + K, H]."""

    def qk_norm_weights(self) -> tuple[jax.Array, jax.Array]:
        H, pd = self.cfg.head_dim, self.param_dtype
        return (self.param("q_norm", nn.initializers.ones, (H,), pd),
                self.param("k_norm", nn.initializers.ones, (H,), pd))

    def normalize_qk(self, qk: jax.Array) -> jax.Array:
        cfg = self.cfg
        N, K, H = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        wq, wk = self.qk_norm_weights()
        w = jnp.concatenate([jnp.broadcast_to(wq, (N, H)), jnp.broadcast_to(wk, (K, H))])
        return common.rms_norm(qk, w, cfg.rms_norm_eps)


class Qwen3ForCausalLM(common.CausalLM):
    """Qwen3 trunk: the Llama trunk with `Qwen3Attention`."""

    attention_cls = Qwen3Attention

