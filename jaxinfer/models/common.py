"""Shared building blocks of the Llama/Qwen3 family, as Flax linen modules over the plain param tree.

The modules create exactly the tree of `jaxinfer.models.params` (per-layer arrays under
``layers/<i>``, fused ``wqkv`` and ``w_gate_up``, ``[in, out]`` matrices): every block declares its
weights with ``self.param(<tree name>, ...)`` and is bound into its parent's scope with
``nn.share_scope``, so no per-module nesting appears below a layer's dict. `Layers` runs the L
`DecoderLayer` modules in a Python loop (unrolled under jit): each layer reads its own weight
arrays, never a slice of a stacked array. The K/V page pools [L, P, K, page_size, H] are threaded
through the loop; layer ``i`` writes them with `jaxinfer.kv_cache.write_kv` at the static index
``i``. The fused projections' outputs are split with slices of the activations (`fused_parts`);
weights are never copied or cast inside the step when they already have the compute dtype.

Numerics: the compute dtype is the params' dtype (bf16 on GPU, f32 in tests); RMSNorm statistics,
RoPE and the attention softmax (inside ``attn_fn``) run in float32; the residual stream stays in the
compute dtype. Sources: Touvron et al. 2023 (Llama), HF ``modeling_llama.py`` / ``modeling_qwen3.py``
(RMSNorm cast order, ``rotate_half`` RoPE, ``_compute_llama3_parameters``), Su et al. 2021 (RoPE),
Shazeer 2020 (SwiGLU).
"""

from __future__ import annotations

import math
from typing import Any, Callable, ClassVar, Mapping, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.config import ModelConfig
from jaxinfer.kv_cache import KVCache, write_kv
from jaxinfer.models.params import fused_parts, layer_keys, layer_param_shapes, param_shapes
from pallas_kernels.sizes import round_up

INIT_STD = 0.02  # HF ``initializer_range`` default: N(0, 0.02) for matrices and the embedding.
# Decode steps of at least DOWN_PARTIALS_MIN_ROWS rows whose add + RMSNorm is the kernel (which
# sums partial sums) run the MLP's down projection as DOWN_PARTIALS float32 partial sums over
# parts of F (`MLP`): on the H200 cuBLAS runs those products faster than the whole [B, F] x [F, D]
# one with its own split-K and reduction launch (Qwen3-8B, B = 128-256: 28-37 us against 31-43
# us in isolation; not at B = 64; BENCHMARKS.md, ninth session).
DOWN_PARTIALS = 2
DOWN_PARTIALS_MIN_ROWS = 128


# --------------------------------------------------------------------------- pure functions
def in_dtype(w: jax.Array, dtype) -> jax.Array:
    """``w`` cast to ``dtype``, or ``w`` itself when it already has it (so a weight in the compute
    dtype costs no weight-sized op in the step)."""
    return w if w.dtype == jnp.dtype(dtype) else w.astype(dtype)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """RMSNorm over the last axis: ``weight * (x / sqrt(mean(x^2) + eps))``.

    Statistics in float32; the normalized value is cast back to ``x.dtype`` before the weight
    multiply (HF ``LlamaRMSNorm`` order). Shapes: x [..., D], weight [D] -> [..., D] in x.dtype.
    Source: Zhang & Sennrich 2019.
    """
    xf = x.astype(jnp.float32)
    var = jnp.mean(jnp.square(xf), axis=-1, keepdims=True)
    normed = (xf * jax.lax.rsqrt(var + eps)).astype(x.dtype)
    return (in_dtype(weight, x.dtype) * normed).astype(x.dtype)


def rope_inv_freq(cfg: ModelConfig) -> np.ndarray:
    """RoPE inverse frequencies f32[H/2]: ``theta^(-2i/H)``, with Llama 3 scaling if configured.

    Computed on the host (the config is static). Llama 3 scaling follows HF
    ``_compute_llama3_parameters``: wavelengths longer than ``orig/low_freq_factor`` are divided by
    ``factor``, shorter than ``orig/high_freq_factor`` kept, and the band between is interpolated.
    """
    H = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (np.arange(0, H, 2, dtype=np.float64) / H))
    rs = cfg.rope_scaling
    if rs is not None:
        orig = rs.original_max_position_embeddings
        low_wavelen = orig / rs.low_freq_factor
        high_wavelen = orig / rs.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = np.where(wavelen > low_wavelen, inv_freq / rs.factor, inv_freq)
        smooth = (orig / wavelen - rs.low_freq_factor) / (rs.high_freq_factor - rs.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rs.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv_freq = np.where(medium, smoothed, scaled)
    return inv_freq.astype(np.float32)


def rope_cos_sin(positions: jax.Array, inv_freq: np.ndarray) -> tuple[jax.Array, jax.Array]:
    """cos and sin f32[B, T, H/2] of the rotation angles ``position * inv_freq``.

    Args:
        positions: i32[B, T] absolute token positions (converted to float32 here).
        inv_freq: f32[H/2] from `rope_inv_freq`.
    """
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq, jnp.float32)
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate ``x`` [B, T, heads, H] by RoPE in the HF ``rotate_half`` convention.

    Dimension i pairs with i + H/2: ``(x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin)``. Computed in
    float32; returned in x.dtype. cos, sin: f32[B, T, H/2] (broadcast over heads).
    """
    xf = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    x1, x2 = xf[..., :half], xf[..., half:]
    c, s = cos[:, :, None, :], sin[:, :, None, :]
    out = jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)
    return out.astype(x.dtype)


class Packing(NamedTuple):
    """Where the tokens of a packed (ragged) prefill batch sit.

    Packed layout: the step's tokens are one row ``[1, Tp]``, sequence after sequence, with no
    padding between them (padding only at the end), so the projections and the MLP run on real
    tokens only. Attention needs them per sequence: row r of the KV state (``block_tables[r]``,
    ``seq_lens[r]``) has its query tokens at packed indices ``q_index[r, :n_r]``.

    q_index:     i32[R, Tq] packed index of row r's j-th query token (padding: any valid index).
    q_positions: i32[R, Tq] its absolute position (padding: 0).
    out_index:   i32[Tp]    ``r * Tq + j`` for the packed token that is row r's j-th (padding: 0).

    Source: vLLM's flattened token batch (``query_start_loc``), expressed as two gathers.
    """

    q_index: jax.Array
    q_positions: jax.Array
    out_index: jax.Array


class StepContext(NamedTuple):
    """Per-step metadata every layer reads (the same arrays for all L layers).

    positions i32[B, T], slot_mapping i32[B, T], block_tables i32[R, M], seq_lens i32[R],
    cos / sin f32[B, T, H/2], packing: `Packing` (then B = 1 and R rows) or None (then R = B).
    """

    positions: jax.Array
    slot_mapping: jax.Array
    block_tables: jax.Array
    seq_lens: jax.Array
    cos: jax.Array
    sin: jax.Array
    packing: Packing | None = None


def attend(attn_fn: Callable, q: jax.Array, k_pool: jax.Array, v_pool: jax.Array,
           ctx: StepContext, *, layer: int, scale: float, num_heads: int) -> jax.Array:
    """``attn_fn`` on q [B, T, N, H] in the step's layout; returns [B, T, N, H]. A decode step's q
    may come grouped by KV head, [B, 1, K, Gp, H] (`Attention.fused_prologue`); ``num_heads`` (N)
    then goes to ``attn_fn`` with it.

    Unpacked: rows are sequences. Packed (``ctx.packing``): the queries [1, Tp, N, H] are gathered
    into [R, Tq, N, H] rows, attended, and gathered back.
    """
    pk = ctx.packing
    if pk is None:
        extra = {"num_heads": num_heads} if q.ndim == 5 else {}
        return attn_fn(q, k_pool, v_pool, ctx.block_tables, ctx.seq_lens, ctx.positions,
                       layer=layer, scale=scale, **extra)
    _, Tp, N, H = q.shape
    R, Tq = pk.q_index.shape
    rows = q[0][pk.q_index]                                             # [R, Tq, N, H]
    o = attn_fn(rows, k_pool, v_pool, ctx.block_tables, ctx.seq_lens, pk.q_positions,
                layer=layer, scale=scale)
    return o.reshape(R * Tq, N, H)[pk.out_index][None]                  # [1, Tp, N, H]


def _shared(parent: nn.Module, child: nn.Module) -> nn.Module:
    """Bind ``child`` into ``parent``'s scope so its params appear directly in the parent's dict."""
    nn.share_scope(parent, child)
    return child


_dense_init = nn.initializers.normal(stddev=INIT_STD)


# --------------------------------------------------------------------------- modules
class AddRMSNorm(nn.Module):
    """Residual add + RMSNorm whose weight [D] is the param named ``param_name`` (e.g.
    "attn_norm"): ``__call__(x [B, T, D], delta [B, T, D] | None) -> (x + delta, rms_norm(x +
    delta))``, both [B, T, D] in x.dtype (`rms_norm`; no add when ``delta`` is None).

    ``delta`` may also be float32 partial sums [splits, B, T, D] of it (`MLP` with
    ``down_partials``): their sum rounded to x.dtype is added.

    ``kernel``: None (jnp ops, fused by XLA) or a function with the signature of
    `pallas_kernels.add_rms_norm.reference.add_rms_norm` over [S, D] rows (one launch).
    """

    param_name: str
    eps: float
    param_dtype: Any = jnp.float32
    kernel: Callable | None = None

    @nn.compact
    def __call__(self, x: jax.Array, delta: jax.Array | None) -> tuple[jax.Array, jax.Array]:
        w = self.param(self.param_name, nn.initializers.ones, (x.shape[-1],), self.param_dtype)
        partials = delta is not None and delta.ndim == x.ndim + 1
        if self.kernel is None:
            if partials:
                delta = delta.sum(0).astype(x.dtype)
            if delta is not None:
                x = x + delta
            return x, rms_norm(x, w, self.eps)
        shape = x.shape
        if delta is not None:
            lead = (delta.shape[0],) if partials else ()
            delta = delta.reshape(*lead, -1, shape[-1])
        x, h = self.kernel(x.reshape(-1, shape[-1]), delta, w, eps=self.eps)
        return x.reshape(shape), h.reshape(shape)


class MLP(nn.Module):
    """SwiGLU feed-forward: ``(silu(x @ w_gate) * (x @ w_up)) @ w_down``; x [B, T, D] -> [B, T, D].

    gate and up are one GEMM with ``w_gate_up`` [D, 2F]; its output [B, T, 2F] is split into the
    gate [B, T, F] and up [B, T, F] halves (`fused_parts`). ``w_down`` [F, D].
    With ``down_partials`` > 1 the down projection is split over that many equal parts of F and
    the output is their float32 partial sums [splits, B, T, D] (for an `AddRMSNorm` to add up).
    Source: Shazeer 2020, "GLU Variants Improve Transformer".
    """

    cfg: ModelConfig
    param_dtype: Any = jnp.float32
    down_partials: int = 1

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        shapes, parts = layer_param_shapes(self.cfg), fused_parts(self.cfg)["w_gate_up"]
        w_gate_up = self.param("w_gate_up", _dense_init, shapes["w_gate_up"], self.param_dtype)
        w_down = self.param("w_down", _dense_init, shapes["w_down"], self.param_dtype)
        with jax.named_scope("mlp"):
            gu = x @ in_dtype(w_gate_up, x.dtype)                       # [B, T, 2F]
            h = jax.nn.silu(gu[..., parts["gate"]]) * gu[..., parts["up"]]
            splits = self.down_partials
            if splits > 1:
                B, T, F = h.shape
                w = in_dtype(w_down, x.dtype).reshape(splits, F // splits, -1)   # a view
                return jnp.einsum("btpf,pfd->pbtd", h.reshape(B, T, splits, F // splits), w,
                                  preferred_element_type=jnp.float32)
            return (h @ in_dtype(w_down, x.dtype)).astype(x.dtype)


class Attention(nn.Module):
    """Llama attention block over the paged KV cache.

    x [B, T, D] -> one GEMM with ``wqkv`` [D, (N + 2K) * H], split into the query and key heads
    qk [B, T, N + K, H] and v [B, T, K, H] (`fused_parts`) -> `normalize_qk` (identity here; Qwen3
    overrides it) -> RoPE at the step's positions, on q and k heads together (one op each over
    N + K heads instead of two, so fewer kernels per layer) -> ``write_kv`` into the pools at
    ``layer`` (a Python int) -> ``attn_fn`` -> ``wo`` [N*H, D]. Returns (out [B, T, D], k_pool, v_pool) with the pools
    [L, P, K, page_size, H] updated. When ``attn_fn`` carries a ``qkv_prologue`` kernel
    (`jaxinfer.attention.make_attention_fn`), every step (decode and packed prefill) runs norm +
    RoPE + K/V write through it (`fused_prologue`) instead.
    """

    cfg: ModelConfig
    attn_fn: Callable
    param_dtype: Any = jnp.float32

    def normalize_qk(self, qk: jax.Array) -> jax.Array:
        """Hook applied to the query and key heads qk [B, T, N + K, H] (the N query heads first)
        before RoPE. Llama: identity."""
        return qk

    def qk_norm_weights(self) -> tuple[jax.Array | None, jax.Array | None]:
        """The RMSNorm weights (q_norm [H], k_norm [H]) that `normalize_qk` applies, for a fused
        prologue kernel; Llama: (None, None)."""
        return None, None

    def fused_prologue(self, prologue: Callable, qkv: jax.Array, layer: int, k_pool: jax.Array,
                       v_pool: jax.Array, ctx: StepContext):
        """q/k norm + RoPE + K/V write of a step in one kernel: ``prologue`` has the signature of
        `pallas_kernels.qkv_prologue.reference.qkv_prologue`. qkv [B, T, (N+2K)*H] -> (q,
        k_pool, v_pool) with q [B, T, N, H], or, in a decode step (T = 1, unpacked) when
        ``attn_fn.q_group_multiple`` is set (the mosaic decode kernel), grouped by KV head
        [B, 1, K, Gp, H] with the G = N/K rows zero-padded to Gp, the next multiple of it (so
        the decode kernel pads nothing)."""
        cfg = self.cfg
        B, T, _ = qkv.shape
        N, K, H = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        mult = getattr(self.attn_fn, "q_group_multiple", None)
        decode = T == 1 and ctx.packing is None
        rows = None if mult is None or not decode else round_up(N // K, mult)
        wq, wk = self.qk_norm_weights()
        q, k_pool, v_pool = prologue(
            qkv.reshape(B * T, -1), wq, wk, ctx.cos.reshape(B * T, -1),
            ctx.sin.reshape(B * T, -1), ctx.slot_mapping.reshape(-1), k_pool, v_pool,
            layer=layer, num_heads=N, num_kv_heads=K, eps=cfg.rms_norm_eps,
            **({} if rows is None else {"q_group_rows": rows}))
        shape = (B, T, N, H) if rows is None else (B, T, K, rows, H)
        return q.reshape(shape), k_pool, v_pool

    @nn.compact
    def __call__(self, x: jax.Array, layer: int, k_pool: jax.Array, v_pool: jax.Array,
                 ctx: StepContext) -> tuple[jax.Array, jax.Array, jax.Array]:
        cfg = self.cfg
        B, T, D = x.shape
        N, K, H = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        shapes, parts = layer_param_shapes(cfg), fused_parts(cfg)["wqkv"]
        wqkv = self.param("wqkv", _dense_init, shapes["wqkv"], self.param_dtype)
        wo = self.param("wo", _dense_init, shapes["wo"], self.param_dtype)
        prologue = getattr(self.attn_fn, "qkv_prologue", None)
        with jax.named_scope("qkv"):
            qkv = x @ in_dtype(wqkv, x.dtype)                           # [B, T, (N + 2K) * H]
            assert parts["q"].start == 0 and parts["q"].stop == parts["k"].start
        if prologue is not None:                                        # one kernel
            with jax.named_scope("qkv_prologue"):
                q, k_pool, v_pool = self.fused_prologue(prologue, qkv, layer, k_pool, v_pool, ctx)
        else:
            qk = qkv[..., :parts["k"].stop].reshape(B, T, N + K, H)
            v = qkv[..., parts["v"]].reshape(B, T, K, H)
            qk = self.normalize_qk(qk)
            with jax.named_scope("rope"):
                qk = apply_rope(qk, ctx.cos, ctx.sin)
                q, k = qk[:, :, :N], qk[:, :, N:]
            with jax.named_scope("kv_write"):
                k_pool, v_pool = write_kv(k_pool, v_pool, layer, k, v, ctx.slot_mapping)
        with jax.named_scope("attention"):
            o = attend(self.attn_fn, q, k_pool, v_pool, ctx, layer=layer, scale=H ** -0.5,
                       num_heads=N)
            out = (o.astype(x.dtype).reshape(B, T, N * H) @ in_dtype(wo, x.dtype)).astype(x.dtype)
        return out, k_pool, v_pool


class DecoderLayer(nn.Module):
    """Pre-norm decoder layer, ``x += attn(attn_norm(x)); x += mlp(mlp_norm(x))``, computed with
    each residual add done together with the norm that follows it (`AddRMSNorm`): the returned
    ``x`` does not include the MLP's output, which is returned *pending* for the next layer (or
    the final norm) to add.

    ``__call__(x [B, T, D], pending [B, T, D] | None, layer, k_pool, v_pool, ctx)`` with
    ``pending`` the previous layer's MLP output (None for layer 0), ``layer`` the static (Python
    int) index into the pools' L axis and ``ctx`` the `StepContext`; returns (x, pending, k_pool,
    v_pool). The add + norm runs through ``attn_fn.add_rms_norm`` when the attention callable
    carries one (`jaxinfer.attention.make_attention_fn`), else through jnp ops; with the kernel,
    decode steps of at least `DOWN_PARTIALS_MIN_ROWS` rows pass the MLP output on as
    `DOWN_PARTIALS` float32 partial sums (`MLP`), which the next add + norm sums.
    Its params form one flat dict (``params["layers"][str(layer)]``).
    """

    cfg: ModelConfig
    attn_fn: Callable
    attention_cls: type = Attention
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array, pending: jax.Array | None, layer: int, k_pool: jax.Array,
                 v_pool: jax.Array, ctx: StepContext
                 ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
        eps, pd = self.cfg.rms_norm_eps, self.param_dtype
        kernel = getattr(self.attn_fn, "add_rms_norm", None)
        x, h = _shared(self, AddRMSNorm("attn_norm", eps, pd, kernel, name="attn_norm_block"))(
            x, pending)
        attn = _shared(self, self.attention_cls(self.cfg, self.attn_fn, pd, name="attention"))
        a, k_pool, v_pool = attn(h, layer, k_pool, v_pool, ctx)
        x, h = _shared(self, AddRMSNorm("mlp_norm", eps, pd, kernel, name="mlp_norm_block"))(x, a)
        B, T = x.shape[:2]
        F = self.cfg.intermediate_size
        split = (kernel is not None and ctx.packing is None and T == 1
                 and B >= DOWN_PARTIALS_MIN_ROWS and F % DOWN_PARTIALS == 0)
        mlp = MLP(self.cfg, pd, DOWN_PARTIALS if split else 1, name="mlp")
        return x, _shared(self, mlp)(h), k_pool, v_pool


class Layers(nn.Module):
    """The L decoder layers, unrolled: a Python loop over `DecoderLayer` children named "0" ..
    str(L-1), so their params land at ``params["layers"][str(i)]`` when this module is named
    "layers". ``__call__(x [B, T, D], k_pool, v_pool, ctx)`` -> (x, pending, k_pool, v_pool):
    the residual stream without the last layer's MLP output ``pending`` [B, T, D] (or its
    float32 partial sums [splits, B, T, D], see `DecoderLayer`; the final norm adds it), the
    pools [L, P, K, page_size, H] written by every layer at its own index.
    """

    cfg: ModelConfig
    attn_fn: Callable
    attention_cls: type = Attention
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array, k_pool: jax.Array, v_pool: jax.Array,
                 ctx: StepContext) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
        pending = None
        for i, name in enumerate(layer_keys(self.cfg)):
            layer = DecoderLayer(self.cfg, self.attn_fn, self.attention_cls, self.param_dtype,
                                 name=name)
            x, pending, k_pool, v_pool = layer(x, pending, i, k_pool, v_pool, ctx)
        return x, pending, k_pool, v_pool


class CausalLM(nn.Module):
    """Decoder-only LM trunk: embed -> `Layers` (L unrolled `DecoderLayer`) -> final norm (which
    also adds the last layer's pending MLP output).

    Subclasses pick the attention block through the class variable ``attention_cls``.
    ``__call__(tokens i32[B, T], positions i32[B, T], slot_mapping i32[B, T], kv: KVCache,
    packing: Packing | None)`` returns (hidden [B, T, D] after the final norm, in the compute
    dtype = params dtype, new KVCache).
    ``lm_head`` [D, V] is declared (when untied) so that ``init`` creates it; logits are computed
    by `compute_logits`.
    """

    cfg: ModelConfig
    attn_fn: Callable
    param_dtype: Any = jnp.float32
    attention_cls: ClassVar[type] = Attention

    @nn.compact
    def __call__(self, tokens: jax.Array, positions: jax.Array, slot_mapping: jax.Array,
                 kv: KVCache, packing: Packing | None = None) -> tuple[jax.Array, KVCache]:
        cfg, pd = self.cfg, self.param_dtype
        V, D = cfg.vocab_size, cfg.hidden_size
        embed = self.param("embed", _dense_init, (V, D), pd)
        if not cfg.tie_word_embeddings:
            self.param("lm_head", _dense_init, (D, V), pd)
        x = jnp.take(embed, tokens, axis=0)                          # [B, T, D], compute dtype
        with jax.named_scope("rope"):
            cos, sin = rope_cos_sin(positions, rope_inv_freq(cfg))
        ctx = StepContext(positions.astype(jnp.int32), slot_mapping.astype(jnp.int32),
                          kv.block_tables, kv.seq_lens, cos, sin, packing)
        layers = Layers(cfg, self.attn_fn, self.attention_cls, pd, name="layers")
        x, pending, k_pool, v_pool = layers(x, kv.k, kv.v, ctx)
        kernel = getattr(self.attn_fn, "add_rms_norm", None)
        _, x = _shared(self, AddRMSNorm("final_norm", cfg.rms_norm_eps, pd, kernel,
                                        name="final_norm_block"))(x, pending)
        return x, kv.replace(k=k_pool, v=v_pool)


# --------------------------------------------------------------------------- functional API
def check_params(params: dict, cfg: ModelConfig) -> None:
    """Check the tree structure and shapes of ``params`` against `param_shapes(cfg)`.

    Raises:
        ValueError: a missing or extra entry, or a wrong shape (named, with both shapes).
    """
    expected = param_shapes(cfg)

    def walk(exp, got, path):
        if not isinstance(got, Mapping):
            raise ValueError(f"params{path} must be a mapping, got {type(got).__name__}")
        missing, extra = set(exp) - set(got), set(got) - set(exp)
        if missing or extra:
            raise ValueError(f"params{path}: missing {sorted(missing)}, unexpected {sorted(extra)} "
                             f"(tie_word_embeddings={cfg.tie_word_embeddings})")
        for name, e in exp.items():
            if isinstance(e, dict):
                walk(e, got[name], f"{path}/{name}")
            elif tuple(got[name].shape) != tuple(e):
                raise ValueError(f"params{path}/{name} has shape {tuple(got[name].shape)}, "
                                 f"expected {tuple(e)}")

    walk(expected, params, "")


def forward_with(model_cls: type, params: dict, cfg: ModelConfig, tokens: jax.Array,
                 positions: jax.Array, slot_mapping: jax.Array, kv: KVCache, *,
                 attn_fn: Callable, packing: Packing | None = None) -> tuple[jax.Array, KVCache]:
    """Run ``model_cls`` (a `CausalLM` subclass) on the plain param tree; see `registry.forward`."""
    check_params(params, cfg)
    model = model_cls(cfg, attn_fn, params["embed"].dtype)
    return model.apply({"params": params}, tokens, positions, slot_mapping, kv, packing)


def init_with(model_cls: type, cfg: ModelConfig, key: jax.Array, dtype,
              attn_fn: Callable) -> dict:
    """Random params of ``model_cls`` for ``cfg``: N(0, 0.02) matrices/embedding, ones for norms."""
    dtype = jnp.dtype(dtype)
    model = model_cls(cfg, attn_fn, dtype)
    page_size = 1
    kv = KVCache(
        k=jnp.zeros((cfg.num_layers, 2, cfg.num_kv_heads, page_size, cfg.head_dim), dtype),
        v=jnp.zeros((cfg.num_layers, 2, cfg.num_kv_heads, page_size, cfg.head_dim), dtype),
        block_tables=jnp.ones((1, 1), jnp.int32), seq_lens=jnp.ones((1,), jnp.int32))
    one = jnp.ones((1, 1), jnp.int32)

    def init(k):
        return model.init(k, one * 0, one * 0, one * page_size, kv)["params"]

    return jax.jit(init)(key)


def compute_logits(params: dict, cfg: ModelConfig, hidden: jax.Array) -> jax.Array:
    """Output logits f32[..., V] = hidden [..., D] @ (lm_head [D, V], or embed.T when tied).

    The matmul runs in the compute dtype with float32 accumulation and output.
    """
    if cfg.tie_word_embeddings:
        w, spec = params["embed"], "...d,vd->...v"
    elif "lm_head" in params:
        w, spec = params["lm_head"], "...d,dv->...v"
    else:
        raise ValueError("params has no 'lm_head' but cfg.tie_word_embeddings=False; "
                         "an untied model needs lm_head [D, V]")
    return jnp.einsum(spec, hidden.astype(w.dtype), w, preferred_element_type=jnp.float32)

