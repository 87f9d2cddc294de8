"""The parameter pytree of the Llama/Qwen3 family, declared once.

Layers are stacked on a leading L axis (the model scans over them). Matrices are stored as
``[in, out]`` so that ``x @ w`` needs no transpose inside the step; loaders transpose HF's
``[out, in]`` tensors once at load time.

    embed       [V, D]
    layers/
      attn_norm [L, D]
      wq        [L, D, N*H]
      wk        [L, D, K*H]
      wv        [L, D, K*H]
      wo        [L, N*H, D]
      q_norm    [L, H]        Qwen3 only (per-head RMSNorm of q)
      k_norm    [L, H]        Qwen3 only
      mlp_norm  [L, D]
      w_gate    [L, D, F]
      w_up      [L, D, F]
      w_down    [L, F, D]
    final_norm  [D]
    lm_head     [D, V]        only when the output head is not tied to ``embed``
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxinfer.config import ModelConfig


def param_shapes(cfg: ModelConfig) -> dict:
    """Nested dict of shape tuples, the layout above, for ``cfg``."""
    V, D, F, L = cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size, cfg.num_layers
    N, K, H = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    layers = {
        "attn_norm": (L, D),
        "wq": (L, D, N * H),
        "wk": (L, D, K * H),
        "wv": (L, D, K * H),
        "wo": (L, N * H, D),
        "mlp_norm": (L, D),
        "w_gate": (L, D, F),
        "w_up": (L, D, F),
        "w_down": (L, F, D),
    }
    if cfg.qk_norm:
        layers["q_norm"] = (L, H)
        layers["k_norm"] = (L, H)
    shapes = {"embed": (V, D), "layers": layers, "final_norm": (D,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head"] = (D, V)
    return shapes


def abstract_params(cfg: ModelConfig, dtype=jnp.bfloat16) -> dict:
    """ShapeDtypeStruct tree of the parameters (for sizing, loading checks and eval_shape tests)."""
    return jax.tree_util.tree_map(lambda s: jax.ShapeDtypeStruct(s, jnp.dtype(dtype)),
                                  param_shapes(cfg), is_leaf=lambda x: isinstance(x, tuple))


def param_bytes(cfg: ModelConfig, dtype_bytes: int = 2) -> int:
    """Total bytes of the parameters."""
    total = 0
    for s in jax.tree_util.tree_leaves(param_shapes(cfg), is_leaf=lambda x: isinstance(x, tuple)):
        n = 1
        for d in s:
            n *= d
        total += n
    return total * dtype_bytes
