"""Llama (2/3/3.x, SmolLM2, ...): the shared blocks of `common` with plain attention.

Source: Touvron et al. 2023, "Llama 2"; Meta "The Llama 3 Herd of Models" (2024); HF
``modeling_llama.py`` (the numerics these functions are tested against).
"""

from __future__ import annotations

from jaxinfer.models import common

LlamaAttention = common.Attention


class LlamaForCausalLM(common.CausalLM):
    """Llama trunk: embed -> L x (RMSNorm, attention, RMSNorm, SwiGLU) -> final RMSNorm."""

    attention_cls = LlamaAttention

