"""Functions and Flax blocks of the Llama/Qwen3 family: compute dtype = params' dtype; RMSNorm
statistics, RoPE and attention softmax in f32; weights ``[in, out]`` (per-channel fp8 ``[out, in]``:
`Weight`). Sources: HF ``modeling_llama.py``; the RMSNorm, RoPE, SwiGLU and PagedAttention
papers."""

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.config.weights import (
    INIT_STD,
    LEAVES,
    layer_leaves,
    scale_shape,
    shape_of,
    stored_shape,
)
from jaxinfer.models.kv_cache import page_dtype
from jaxinfer.models.lora import LoRAStep
from jaxinfer.models.quantize import FP8, expand_scale, w8a8_gemm, w8a8_matmul
from pallas_kernels.kv_quant import quantize

INITS = {"normal": nn.initializers.normal(stddev=INIT_STD), "ones": nn.initializers.ones}


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["w", "scale"],
    meta_fields=["block", "w8a8", "observe"],
)
@dataclasses.dataclass(frozen=True)
class Weight:
    """A matrix and its scales. ``w``: [in, out] in the compute dtype (``scale`` None), or
    float8_e4m3fn with an f32 `scale_shape` scale (static ``block``: None per channel, or an HF
    block): per channel, ``w`` is stored K-major [out, in] with ``scale`` f32[out]
    (`weights.kmajor`: cuBLASLt's fp8 GEMM wants K contiguous in both operands, and an [in, out]
    weight costs a transpose on every call), an HF block-scaled ``w`` stays [in, out]. (MoE expert
    stacks are [E, in, out] with f32[E, out] per channel or f32[E, in/bi, out/bo] per block, read
    by `moe.grouped_dense` only, never by `value` or `dense`.) Static ``w8a8``: a per-channel fp8
    weight multiplied with fp8 activations (`dense`); static ``observe``: calibration only,
    called by `dense` on its input x (`smoothquant.Probe`)."""

    w: jax.Array
    scale: jax.Array | None = None
    block: tuple[int, int] | None = None
    w8a8: bool = False
    observe: Callable[[jax.Array], None] | None = None

    def value(self, dtype) -> jax.Array:
        """The [in, out] matrix ``w`` means, in ``dtype``: ``w.astype(f32) * expand_scale(scale)``
        (transposed back where per channel), traced (fused into the GEMM)."""
        if self.scale is None:
            return self.w.astype(dtype)
        wf = self.w.astype(jnp.float32) * expand_scale(self.scale, self.w.shape, self.block)
        return (wf if self.block else jnp.swapaxes(wf, -1, -2)).astype(dtype)


@functools.partial(
    jax.tree_util.register_dataclass, data_fields=["q", "scale"], meta_fields=["dtype"]
)
@dataclasses.dataclass(frozen=True)
class Quantized:
    """Activations quantised per token by the op that produced them (`kernels.ActQuant`), the
    input of a W8A8 `dense`: ``q`` float8_e4m3fn [..., in] and ``scale`` f32[..., 1]
    (`quantize.quantize_tokens`' contract); static ``dtype``: the compute dtype they stand for,
    that of `dense`'s output. ``shape`` is q's: code sizing by its input reads either kind."""

    q: jax.Array
    scale: jax.Array
    dtype: Any

    shape = property(lambda self: self.q.shape)


def dense(x: jax.Array | Quantized, w: Weight) -> jax.Array:
    """The GEMM of every projection: x [..., in] times the matrix ``w`` means (`Weight.value`)
    -> [..., out]. fp8 with per-channel scales (K-major w [out, in]): the e4m3 weight (exact in
    bf16) in one ``dot_general`` contracting both last axes, f32 accumulation, the scale applied to
    the output, so no scaled copy of the weight is written each step; ``w.w8a8``: x quantised per
    token too, one e4m3 x e4m3 GEMM (`quantize.w8a8_matmul`), or x `Quantized` already
    (`quantize.w8a8_gemm`; ValueError with a weight not W8A8); ``w.observe``: called on x first."""
    if isinstance(x, Quantized):
        if not w.w8a8:
            raise ValueError("a Quantized input needs a W8A8 weight (per-channel fp8, w8a8=True)")
        return w8a8_gemm(x.q, x.scale, w.w, w.scale).astype(x.dtype)
    if w.observe is not None:
        w.observe(x)
    if w.w8a8:
        return w8a8_matmul(x, w.w, w.scale).astype(x.dtype)
    if w.scale is None or w.block is not None:
        return x @ w.value(x.dtype)
    dims = (((x.ndim - 1,), (1,)), ((), ()))
    y = jax.lax.dot_general(x, w.w.astype(x.dtype), dims, preferred_element_type=jnp.float32)
    return (y * w.scale).astype(x.dtype)


def declare(module: nn.Module, name: str, layer: int | None = None) -> Weight | jax.Array | None:
    """Declare leaf ``name`` of the weight table (`config.weights`) in ``module``'s scope: shape
    of ``module.cfg``, the table's init, ``module.param_dtype``; a quantisable matrix as a `Weight`
    (``module.quantization`` "fp8": float8_e4m3fn of `stored_shape`, K-major [out, in] per channel,
    plus f32 ``name_scale`` of `scale_shape`; W8A8 where ``module.kernels.fp8_gemm`` is "w8a8" and
    the scales are per channel; observed by ``module.kernels.observe.probe(name)`` where that is
    set, `smoothquant.ActivationMax`).
    None: a leaf this model (layer ``layer``'s `layer_leaves`, if given) does not have."""
    leaf, shape, block = LEAVES[name], shape_of(name, module.cfg), module.cfg.weight_block_size
    if (
        not leaf.when(module.cfg)
        or layer is not None
        and name not in layer_leaves(module.cfg, layer)
    ):
        return None
    fp8 = leaf.fp8 and module.quantization is not None
    stored = stored_shape(name, shape, block, fp8)
    w = module.param(name, INITS[leaf.init], stored, FP8 if fp8 else module.param_dtype)
    if not fp8:
        observe = module.kernels.observe
        return Weight(w, observe=observe and observe.probe(name)) if leaf.fp8 else w
    return Weight(
        w,
        module.param(name + "_scale", nn.initializers.ones, scale_shape(shape, block), jnp.float32),
        block,
        block is None and module.kernels.fp8_gemm == "w8a8",
    )


def rope_inv_freq(cfg) -> np.ndarray:
    """RoPE inverse frequencies f32[H/2], ``theta^(-2i/H)``, on the host; Llama 3 scaling (HF
    ``_compute_llama3_parameters``): wavelengths > ``orig/low_freq_factor`` divided by ``factor``,
    < ``orig/high_freq_factor`` kept, the band between interpolated."""
    H = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (np.arange(0, H, 2, dtype=np.float64) / H))
    if (rs := cfg.rope_scaling) is not None:
        orig, wavelen = rs.original_max_position_embeddings, 2 * math.pi / inv_freq
        scaled = np.where(wavelen > orig / rs.low_freq_factor, inv_freq / rs.factor, inv_freq)
        smooth = (orig / wavelen - rs.low_freq_factor) / (rs.high_freq_factor - rs.low_freq_factor)
        medium = (wavelen >= orig / rs.high_freq_factor) & (wavelen <= orig / rs.low_freq_factor)
        inv_freq = np.where(medium, (1 - smooth) * scaled / rs.factor + smooth * scaled, scaled)
    return inv_freq.astype(np.float32)


def rope_cos_sin(positions: jax.Array, inv_freq: np.ndarray) -> tuple[jax.Array, jax.Array]:
    """cos, sin f32[B, T, H/2] of the angles ``positions i32[B, T] * inv_freq f32[H/2]``."""
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq, jnp.float32)
    return jnp.cos(angles), jnp.sin(angles)


class Ragged(NamedTuple):
    """Ragged rows over tokens [1, T]: row r's queries are tokens ``[query_start_loc[r],
    query_start_loc[r + 1])`` (i32[R + 1]; `pallas_kernels.paged_attention.ragged`). Source:
    vLLM's ``query_start_loc``. ``token_tables`` i32[T, M], ``token_lens`` i32[T] (`by_token`):
    each token as one decode row (its row's block table; KV length its position + 1, 0 for
    padding), attended by the decode kernel; None: by the ragged tiles."""

    query_start_loc: jax.Array
    token_tables: jax.Array | None = None
    token_lens: jax.Array | None = None


def by_token(query_start_loc: jax.Array, block_tables: jax.Array, positions: jax.Array) -> Ragged:
    """`Ragged` rows ``query_start_loc`` i32[R + 1] with each of the T tokens at ``positions``
    i32[T] made a decode row: a small step (a verify step's k + 1 tokens a row) reads each row's
    KV with the decode kernel's split over the context, where the ragged tiles would give one
    tile a row. Tokens past ``query_start_loc[R]`` are padding (KV length 0)."""
    t = jnp.arange(positions.shape[0], dtype=jnp.int32)
    row = jnp.searchsorted(query_start_loc, t, side="right") - 1
    row = jnp.clip(row, 0, block_tables.shape[0] - 1)
    lens = jnp.where(t < query_start_loc[-1], positions + 1, 0).astype(jnp.int32)
    return Ragged(query_start_loc, block_tables[row], lens)


class StepContext(NamedTuple):
    """Per-step metadata: positions, slot_mapping i32[B, T], block_tables i32[R, M], seq_lens
    i32[R], cos/sin f32[B, T, H/2], ragged (None: R = B rows of T tokens; else tokens [1, T] in
    R ragged rows); k_scale ... v_mean: `KVCache.scales`; lora: the step's adapters or None."""

    positions: jax.Array
    slot_mapping: jax.Array
    block_tables: jax.Array
    seq_lens: jax.Array
    cos: jax.Array
    sin: jax.Array
    ragged: Ragged | None = None
    k_scale: jax.Array | None = None
    v_scale: jax.Array | None = None
    k_mean: jax.Array | None = None
    v_mean: jax.Array | None = None
    lora: LoRAStep | None = None


def attend(
    kernels,
    q: jax.Array,
    k_pool: jax.Array,
    v_pool: jax.Array,
    ctx: StepContext,
    *,
    layer,
    scale: float,
) -> jax.Array:
    """Attention of q [B, T, N, H] -> [B, T, N, H]: ``kernels.attention`` on B rows of T tokens
    (``ctx.ragged`` None) or on the T decode rows of `by_token`, else ``kernels.ragged`` on the
    ragged rows of q [1, T, N, H]."""
    k_pool, v_pool = (p.view(page_dtype(p.dtype)) for p in (k_pool, v_pool))  # `stored_dtype`
    scales = dict(k_scale=ctx.k_scale, v_scale=ctx.v_scale)
    if ctx.ragged is None:
        return kernels.attention(
            q,
            k_pool,
            v_pool,
            ctx.block_tables,
            ctx.seq_lens,
            ctx.positions,
            layer=layer,
            scale=scale,
            **scales,
        )
    if ctx.ragged.token_lens is not None:  # `by_token`: [T, 1] decode rows
        o = kernels.attention(
            q[0][:, None],
            k_pool,
            v_pool,
            ctx.ragged.token_tables,
            ctx.ragged.token_lens,
            ctx.positions[0][:, None],
            layer=layer,
            scale=scale,
            **scales,
        )
        return o[:, 0][None]
    o = kernels.ragged(
        q[0],
        k_pool,
        v_pool,
        ctx.block_tables,
        ctx.seq_lens,
        ctx.ragged.query_start_loc,
        layer=layer,
        scale=scale,
        **scales,
    )
    return o[None]


def rms_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    """``w * x / sqrt(mean(x^2) + eps)`` over the last axis in x.dtype (HF ``LlamaRMSNorm``: f32
    statistics, the normalised value rounded to x.dtype before the multiply by w)."""
    xf = x.astype(jnp.float32)
    var = jnp.mean(jnp.square(xf), axis=-1, keepdims=True)
    return w.astype(x.dtype) * (xf * jax.lax.rsqrt(var + eps)).astype(x.dtype)


def add_rms_norm(
    x: jax.Array, delta: jax.Array | None, w: jax.Array, *, eps: float
) -> tuple[jax.Array, jax.Array]:
    """vLLM's ``fused_add_rms_norm``: x, delta [B, T, D] (None: x unchanged), w [D] -> (x + delta,
    its `rms_norm`) in x.dtype."""
    if delta is not None:
        x = (x + delta).astype(x.dtype)
    return x, rms_norm(x, w, eps)


def rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """HF ``rotate_half`` RoPE of x [..., heads, H] (i pairs with i + H/2: ``(x1, x2) -> (x1 cos -
    x2 sin, x2 cos + x1 sin)``) in f32, returned in x.dtype; cos, sin f32[..., H/2] (all heads)."""
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    c, s = cos[..., None, :], sin[..., None, :]
    return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).astype(x.dtype)


def write_kv(
    k_pool: jax.Array,
    v_pool: jax.Array,
    layer: int,
    k: jax.Array,
    v: jax.Array,
    slot_mapping: jax.Array,
    k_scale=None,
    v_scale=None,
    k_mean=None,
    v_mean=None,
) -> tuple[jax.Array, jax.Array]:
    """Scatter k, v [S, K, H] into ``layer`` of pools [L, P, K, page_size, H] (kept in a
    `stored_dtype`) at ``slot_mapping`` i32[S] (``page * page_size + offset``; fp8 pages:
    `kv_quant.quantize` of ``x - mean`` by the scale, scales f32[L, K], means f32[L, K, H] or
    None) -> pools. Out of range: undefined."""
    page, off = jnp.divmod(slot_mapping, k_pool.shape[3])  # shape[3]: page_size
    ks, vs = (None if x is None else x[layer][None, :, None] for x in (k_scale, v_scale))
    km, vm = (x if x is None else x[layer] for x in (k_mean, v_mean))
    return tuple(
        pool.at[layer, page, :, off, :].set(
            quantize(x if m is None else x - m, s, page_dtype(pool.dtype)).view(pool.dtype),
            mode="promise_in_bounds",
        )
        for pool, x, s, m in ((k_pool, k, ks, km), (v_pool, v, vs, vm))
    )


def mlp(
    x: jax.Array | Quantized,
    w_gate_up: Weight,
    w_down: Weight,
    shards: int = 1,
    adapt=None,
    silu_quant: Callable[[jax.Array], Quantized] | None = None,
) -> jax.Array:
    """SwiGLU ``(silu(x @ w_gate) * (x @ w_up)) @ w_down``: x [B, T, D] (`Quantized` for a W8A8
    ``w_gate_up``) -> [B, T, D] in x.dtype; ``w_gate_up`` [D, 2F] ([gate | up] in each of
    ``shards`` column groups, `engine_layout`), ``w_down`` [F, D]; ``adapt(y, x, group)``: LoRA's
    addition to each GEMM's output (`models.lora.add_lora`; shards 1), or None; ``silu_quant``:
    None, or (a W8A8 ``w_down``, shards 1, no adapt) gate_up [B, T, 2F] -> the SwiGLU product
    `Quantized` [B, T, F] (`kernels.ActQuant.silu_mul`)."""
    adapt = adapt or (lambda y, x, group: y)
    with jax.named_scope("mlp"):
        gu = adapt(dense(x, w_gate_up), x, "w_gate_up")  # [B, T, 2F]
        if silu_quant is not None:
            h = silu_quant(gu)
        else:
            gu = gu.reshape(*gu.shape[:-1], shards, 2, -1)  # [B, T, shards, 2, F/s]
            h = (jax.nn.silu(gu[..., 0, :]) * gu[..., 1, :]).reshape(*x.shape[:-1], -1)  # [B,T,F]
        return adapt(dense(h, w_down), h, "w_down").astype(x.dtype)
