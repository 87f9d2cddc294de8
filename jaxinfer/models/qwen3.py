"""Qwen3 (dense): Llama blocks plus a per-head RMSNorm of q and k before RoPE.

Source: Qwen Team 2025, "Qwen3 Technical Report" (QK-Norm replaces Qwen2's QKV bias); HF
``modeling_qwen3.py`` (``q_norm``/``k_norm`` over the head dim, applied before ``apply_rotary_pos_emb``).
"""

from __future__ import annotations

import jax

from jaxinfer.models import common


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

