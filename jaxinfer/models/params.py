"""The parameter pytree of the Llama/Qwen3 family, declared once.

Each layer's weights are separate arrays under ``layers/<i>`` (keys "0" .. str(L-1)): the model
loops over the layers in Python (unrolled), so no weight is ever sliced out of a stacked [L, ...]
array inside the step (on the H200 a scan over stacked weights copied every layer's slice each
decode step: 11.6 ms vs 5.0 ms, ``scripts/probe_layer_scan.py``). Matrices are stored as
``[in, out]`` so that ``x @ w`` needs no transpose inside the step; loaders transpose HF's
``[out, in]`` tensors once at load time. The q/k/v projections are one matrix, and so are gate/up
(fewer, larger GEMMs, as vLLM's QKVParallelLinear / MergedColumnParallelLinear); `fused_parts`
says where each projection lies on the output axis.

    embed         [V, D]
    layers/
      "0" .. str(L-1)/
        attn_norm [D]
        wqkv      [D, (N + 2K) * H]   q | k | v along the output axis
        wo        [N*H, D]
        q_norm    [H]                 Qwen3 only (per-head RMSNorm of q)
        k_norm    [H]                 Qwen3 only
        mlp_norm  [D]
        w_gate_up [D, 2F]             gate | up along the output axis
        w_down    [F, D]
    final_norm    [D]
    lm_head       [D, V]              only when the output head is not tied to ``embed``
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxinfer.config import ModelConfig


def layer_keys(cfg: ModelConfig) -> tuple[str, ...]:
    """The keys of ``params["layers"]``, in layer order: "0", "1", ..., str(L-1)."""
    return tuple(str(i) for i in range(cfg.num_layers))


def fused_parts(cfg: ModelConfig) -> dict[str, dict[str, slice]]:
    """Where each projection lies on the output (last) axis of the fused matrices.

    ``{"wqkv": {"q": [0, N*H), "k": [N*H, (N+K)*H), "v": [(N+K)*H, (N+2K)*H)},
    "w_gate_up": {"gate": [0, F), "up": [F, 2F)}}`` as slices, in concatenation order.
    """
    N, K, H, F = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size
    return {"wqkv": {"q": slice(0, N * H), "k": slice(N * H, (N + K) * H),
                     "v": slice((N + K) * H, (N + 2 * K) * H)},
            "w_gate_up": {"gate": slice(0, F), "up": slice(F, 2 * F)}}


def layer_param_shapes(cfg: ModelConfig) -> dict:
    """Shape tuples of one layer's params (every layer has the same)."""
    D, F = cfg.hidden_size, cfg.intermediate_size
    N, K, H = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    layer = {
        "attn_norm": (D,),
        "wqkv": (D, (N + 2 * K) * H),
        "wo": (N * H, D),
        "mlp_norm": (D,),
        "w_gate_up": (D, 2 * F),
        "w_down": (F, D),
    }
    if cfg.qk_norm:
        layer["q_norm"] = (H,)
        layer["k_norm"] = (H,)
    return layer


def param_shapes(cfg: ModelConfig) -> dict:
    """Nested dict of shape tuples, the layout above, for ``cfg``."""
    V, D = cfg.vocab_size, cfg.hidden_size
    shapes = {"embed": (V, D),
              "layers": {k: layer_param_shapes(cfg) for k in layer_keys(cfg)},
              "final_norm": (D,)}
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
