"""Qwen3 (dense): the Llama trunk plus a per-head RMSNorm of q and k before RoPE.

Source: Qwen Team 2025, "Qwen3 Technical Report" (QK-Norm); HF ``modeling_qwen3.py`` (``q_norm`` /
``k_norm`` over the head dim, applied before ``apply_rotary_pos_emb``)."""

from __future__ import annotations

import flax.linen as nn
import jax

from jaxinfer.models.llama import Attention, LlamaForCausalLM


class Qwen3Attention(Attention):
    """`Attention` plus RMSNorm of each query head (``q_norm`` [H]) and key head (``k_norm``)."""

    def qk_norm_weights(self) -> tuple[jax.Array, jax.Array]:
        H, pd = self.cfg.head_dim, self.param_dtype
        return (self.param("q_norm", nn.initializers.ones, (H,), pd),
                self.param("k_norm", nn.initializers.ones, (H,), pd))


class Qwen3ForCausalLM(LlamaForCausalLM):
    """The Llama trunk with `Qwen3Attention`."""

    attention_cls = Qwen3Attention
