"""The EAGLE-3 draft head (Li et al. 2025, arXiv 2503.01840) as pure functions over its own
one-layer paged KV pool; the layout of vLLM's ``llama_eagle3.py`` (``Eagle3LlamaForCausalLM``,
``norm_before_residual`` False) and SpecForge's ``llama3_eagle.py``. Read by
`checkpoints_tools.eagle3`; ``cfg``: the head's `ModelConfig` (one Llama layer of the target's
width D, V the target's vocabulary).

Params (`params_from_leaves`): fc [3D, D]; input_norm, hidden_norm, post_norm, norm [D]; wqkv
[2D, (N + 2K) H] (q | k | v); wo [N H, D]; w_gate_up [D, 2F] (gate | up); w_down [F, D];
lm_head [D, Vd]; d2t i32[Vd] (target id = draft id + d2t[draft id]); embed [V, D] only when
the checkpoint has its own (else the target's is passed in). Matrices are `Weight`s.

The head's entry at position q is its layer's K/V of the pair (embedding of token q + 1,
hidden h_q), where h_q = fc(the target's aux states at q) or, for drafted positions, the
head's own pre-norm output at q - 1 (the test-time recurrence)."""

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxinfer.models.kv_cache import KVCache
from jaxinfer.models.layers import (
    StepContext,
    Weight,
    dense,
    mlp,
    rms_norm,
    rope,
    rope_cos_sin,
    rope_inv_freq,
    write_kv,
)
from jaxinfer.models.llama import DecoderLayer, attention_heads

MATRICES = ("fc", "wqkv", "wo", "w_gate_up", "w_down")


def params_from_leaves(leaves: dict, dtype) -> dict:
    """The head's params from `checkpoints_tools.eagle3.to_leaves`' numpy leaves: floats in
    ``dtype`` (matrices as `Weight`), ``d2t`` i32; ``t2d`` never present."""
    out = {}
    for name, x in leaves.items():
        if name == "d2t":
            out[name] = jnp.asarray(x, jnp.int32)
        else:
            a = jnp.asarray(x, dtype)
            out[name] = Weight(a) if name in MATRICES else a
    return out


def combine(params: dict, aux: jax.Array) -> jax.Array:
    """fc: the target's three aux states concatenated, [..., 3D] -> [..., D]."""
    return dense(aux, params["fc"])


def _qkv(params: dict, cfg, embeds: jax.Array, hidden: jax.Array) -> jax.Array:
    """[..., (N + 2K) H]: wqkv over concat(input_norm(embeds), hidden_norm(hidden)) [..., 2D]."""
    eps = cfg.rms_norm_eps
    x = jnp.concatenate(
        [rms_norm(embeds, params["input_norm"], eps), rms_norm(hidden, params["hidden_norm"], eps)],
        axis=-1,
    )
    return dense(x, params["wqkv"])


def _embed(params: dict, embed: jax.Array, tokens: jax.Array, dtype) -> jax.Array:
    table = params.get("embed", embed)
    return jnp.take(table, tokens, axis=0).astype(dtype)


def write_entries(
    params: dict,
    cfg,
    embed: jax.Array,
    tokens: jax.Array,
    hidden: jax.Array,
    positions: jax.Array,
    slots: jax.Array,
    kv: KVCache,
) -> KVCache:
    """Write the head's entries (K/V only; one layer, so no attention is needed): tokens,
    positions, slots i32[S] (the entry's position q, token q + 1, slot of q; padding: the null
    page), hidden [S, D] (h_q) -> kv with its pools written. ``embed`` [V, D]: the target's."""
    N, K, H = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    qkv = _qkv(params, cfg, _embed(params, embed, tokens, hidden.dtype), hidden)
    k = qkv[:, N * H : (N + K) * H].reshape(-1, K, H)
    v = qkv[:, (N + K) * H :].reshape(-1, K, H)
    cos, sin = rope_cos_sin(positions, rope_inv_freq(cfg))
    k_pool, v_pool = write_kv(kv.k, kv.v, 0, rope(k, cos, sin), v, slots)
    return kv.replace(k=k_pool, v=v_pool)


def decode(
    params: dict,
    cfg,
    embed: jax.Array,
    tokens: jax.Array,
    hidden: jax.Array,
    positions: jax.Array,
    slots: jax.Array,
    kv: KVCache,
    *,
    kernels,
) -> tuple[jax.Array, jax.Array, KVCache]:
    """One drafting step of R rows: tokens, positions, slots i32[R] (entry q = position),
    hidden [R, D] (h_q); ``kv``'s block_tables i32[R, M] and seq_lens i32[R] (q + 1) ->
    (draft logits f32[R, Vd], the pre-norm output [R, D] (h_{q+1} of the next step), kv with
    entry q written). Attention by ``kernels.attention`` (decode layout [R, 1])."""
    R, D = hidden.shape
    N, K, H = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    qkv = _qkv(params, cfg, _embed(params, embed, tokens, hidden.dtype), hidden)[:, None]
    cos, sin = rope_cos_sin(positions[:, None], rope_inv_freq(cfg))
    ctx = StepContext(positions[:, None], slots[:, None], kv.block_tables, kv.seq_lens, cos, sin)
    o, k_pool, v_pool = attention_heads(
        qkv,
        kv.k,
        kv.v,
        ctx,
        None,
        None,
        kernels=kernels,
        layer=jnp.int32(0),
        num_heads=N,
        num_kv_heads=K,
        eps=cfg.rms_norm_eps,
    )
    x = hidden + dense(o.astype(hidden.dtype).reshape(R, N * H), params["wo"]).astype(hidden.dtype)
    h = rms_norm(x, params["post_norm"], cfg.rms_norm_eps)
    x = x + mlp(h, params["w_gate_up"], params["w_down"])
    out = rms_norm(x, params["norm"], cfg.rms_norm_eps)
    w = params["lm_head"]
    logits = jnp.einsum("rd,dv->rv", out.astype(w.dtype), w, preferred_element_type=jnp.float32)
    return logits, x, kv.replace(k=k_pool, v=v_pool)


def to_target(params: dict, draft_ids: jax.Array) -> jax.Array:
    """Target token ids of draft-vocabulary ids: ``d + d2t[d]`` (vLLM's draft_id_to_target_id)."""
    return draft_ids + params["d2t"][draft_ids]


class AuxCapture:
    """A Flax method interceptor (``with nn.intercept_methods(capture):`` around the target's
    forward) recording the residual stream entering each decoder layer i (vLLM's ``hidden_states
    + residual`` before layer i; i = L: after the last layer, before the final norm), so the
    target's modules stay unchanged and programs without EAGLE-3 are untouched. ``layers``: the
    ids `aux` concatenates."""

    def __init__(self, layers: tuple[int, ...]) -> None:
        self.layers, self.seen = tuple(layers), {}

    def __call__(self, next_fun, args, kwargs, context):
        out = next_fun(*args, **kwargs)
        if isinstance(context.module, DecoderLayer) and context.method_name == "__call__":
            i, (x, pending) = int(context.module.name), args[:2]
            if i == 0:
                self.seen[0] = x if pending is None else (x + pending).astype(x.dtype)
            self.seen[i + 1] = (out[0] + out[1]).astype(out[0].dtype)
        return out

    def aux(self) -> jax.Array:
        """The captured streams of ``layers`` concatenated: [..., 3D] in the compute dtype.
        KeyError: a layer the forward did not run."""
        return jnp.concatenate([self.seen[i] for i in self.layers], axis=-1)

    def capturing(self):
        """The context manager that installs this interceptor."""
        return nn.intercept_methods(self)
