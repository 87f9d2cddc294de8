"""Functions and Flax blocks of the Llama/Qwen3 family. Numerics: compute dtype = params' dtype;
RMSNorm statistics, RoPE and attention softmax in f32. Weights ``[in, out]``. Sources: HF
``modeling_llama.py`` (RMSNorm cast order, ``rotate_half`` RoPE, ``_compute_llama3_parameters``),
Zhang & Sennrich 2019 (RMSNorm), Su et al. 2021 (RoPE), Shazeer 2020 (SwiGLU)."""

import dataclasses
import functools
import math
from typing import Any, Callable, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.quantize import expand_scale, scale_shape
from jaxinfer.step_input import names
from pallas_kernels.add_rms_norm import reference as add_rms_norm_reference

INIT_STD = 0.02  # HF ``initializer_range`` default: N(0, 0.02) for matrices and the embedding.
dense_init = nn.initializers.normal(stddev=INIT_STD)


def fused_parts(cfg, shards: int = 1) -> dict[str, dict[str, slice]]:
    """Slices of each projection on the output (last) axis of the fused matrices: ``{"wqkv": {"q":
    [0, N*H), "k": [N*H, (N+K)*H), "v": [(N+K)*H, (N+2K)*H)}, "w_gate_up": {"gate": [0, F), "up":
    [F, 2F)}}``. ``shards`` > 1: columns grouped by shard, [q_0 | k_0 | v_0 | q_1 | ...], [gate_0 |
    up_0 | gate_1 | ...], slices within one group (N, K, F divided by ``shards``)."""
    N, K, F = cfg.num_heads // shards, cfg.num_kv_heads // shards, cfg.intermediate_size // shards
    H = cfg.head_dim
    return {"wqkv": {"q": slice(0, N * H), "k": slice(N * H, (N + K) * H),
                     "v": slice((N + K) * H, (N + 2 * K) * H)},
            "w_gate_up": {"gate": slice(0, F), "up": slice(F, 2 * F)}}


@functools.partial(jax.tree_util.register_dataclass, data_fields=["w", "scale"],
                   meta_fields=["block"])
@dataclasses.dataclass(frozen=True)
class Weight:
    """w [in, out]: compute dtype (``scale`` None), or float8_e4m3fn with an f32 `scale_shape` scale
    (static ``block``: None per channel, or an HF block): ``w * expand_scale(scale)``."""

    w: jax.Array
    scale: jax.Array | None = None
    block: tuple[int, int] | None = None

    def value(self, dtype) -> jax.Array:
        """``(w.astype(f32) * expand_scale(scale)).astype(dtype)``, traced (fused into the GEMM)."""
        if self.scale is None:
            return self.w.astype(dtype)
        wf = self.w.astype(jnp.float32) * expand_scale(self.scale, self.w.shape, self.block)
        return wf.astype(dtype)


def dense(x: jax.Array, w: Weight) -> jax.Array:
    """The GEMM of every projection: x [..., in] @ ``w.value(x.dtype)`` [in, out] -> [..., out]."""
    return x @ w.value(x.dtype)


def declare_weight(module: nn.Module, name: str, shape: tuple[int, int]) -> Weight:
    """Declare ``name`` [in, out]; fp8: float8_e4m3fn plus f32 ``name_scale``, `scale_shape`."""
    if module.quantization is None:
        return Weight(module.param(name, dense_init, shape, module.param_dtype))
    block = module.cfg.weight_block_size
    return Weight(module.param(name, dense_init, shape, jnp.float8_e4m3fn),
                  module.param(name + "_scale", nn.initializers.ones, scale_shape(shape, block),
                               jnp.float32), block)


def rope_inv_freq(cfg) -> np.ndarray:
    """RoPE inverse frequencies f32[H/2], ``theta^(-2i/H)``, on the host; Llama 3 scaling (HF
    ``_compute_llama3_parameters``): wavelengths > ``orig/low_freq_factor`` divided by ``factor``,
    < ``orig/high_freq_factor`` kept, the band between interpolated."""
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
    """cos, sin f32[B, T, H/2] of the angles ``positions i32[B, T] * inv_freq f32[H/2]``."""
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq, jnp.float32)
    return jnp.cos(angles), jnp.sin(angles)


Packing = NamedTuple("Packing", [(n, jax.Array) for n in names("packing")[1]])
Packing.__doc__ = """A packed prefill batch: tokens [1, Tp], sequence after sequence, padding at the
    end. q_index i32[R, Tq]: packed index of KV row r's j-th query; q_positions i32[R, Tq]: its
    position; out_index i32[Tp]: ``r * Tq + j`` per packed token ("packing" in
    `jaxinfer.step_input.FIELDS`). Source: vLLM's ``query_start_loc``."""


class StepContext(NamedTuple):
    """Per-step metadata: positions, slot_mapping i32[B, T], block_tables i32[R, M], seq_lens
    i32[R], cos/sin f32[B, T, H/2], packing (None: R = B); k_scale, v_scale: `KVCache.scales`."""

    positions: jax.Array
    slot_mapping: jax.Array
    block_tables: jax.Array
    seq_lens: jax.Array
    cos: jax.Array
    sin: jax.Array
    packing: Packing | None = None
    k_scale: jax.Array | None = None
    v_scale: jax.Array | None = None


def attend(attn: Callable, q: jax.Array, k_pool: jax.Array, v_pool: jax.Array,
           ctx: StepContext, *, layer: int, scale: float, num_heads: int) -> jax.Array:
    """``attn`` on q [B, T, N, H] (decode: maybe [B, 1, K, Gp, H]) -> [B, T, N, H]; packs rows."""
    pk, scales = ctx.packing, dict(layer=layer, scale=scale, k_scale=ctx.k_scale,
                                   v_scale=ctx.v_scale)
    if pk is None:
        return attn(q, k_pool, v_pool, ctx.block_tables, ctx.seq_lens, ctx.positions, **scales,
                    **({"num_heads": num_heads} if q.ndim == 5 else {}))
    _, Tp, N, H = q.shape
    R, Tq = pk.q_index.shape
    rows = q[0][pk.q_index]                                             # [R, Tq, N, H]
    o = attn(rows, k_pool, v_pool, ctx.block_tables, ctx.seq_lens, pk.q_positions, **scales)
    return o.reshape(R * Tq, N, H)[pk.out_index][None]                  # [1, Tp, N, H]


def shared(parent: nn.Module, child: nn.Module) -> nn.Module:
    """Bind ``child`` into ``parent``'s scope: its params appear directly in the parent's dict."""
    nn.share_scope(parent, child)
    return child


class AddRMSNorm(nn.Module):
    """Residual add + RMSNorm, weight [D] named ``param_name``: ``(x [B, T, D], delta [B, T, D] |
    None) -> (x + delta, rms_norm(x + delta))`` in x.dtype; ``delta`` may be f32 partial sums
    [splits, B, T, D]. ``kernel``: `ModelKernels.add_rms_norm` (None: the jnp reference)."""

    param_name: str
    eps: float
    param_dtype: Any = jnp.float32
    kernel: Callable | None = None

    @nn.compact
    def __call__(self, x: jax.Array, delta: jax.Array | None) -> tuple[jax.Array, jax.Array]:
        w = self.param(self.param_name, nn.initializers.ones, (x.shape[-1],), self.param_dtype)
        shape = x.shape
        if delta is not None:
            lead = (delta.shape[0],) if delta.ndim == x.ndim + 1 else ()
            delta = delta.reshape(*lead, -1, shape[-1])
        kernel = self.kernel or add_rms_norm_reference.add_rms_norm
        x, h = kernel(x.reshape(-1, shape[-1]), delta, w, eps=self.eps)
        return x.reshape(shape), h.reshape(shape)


class MLP(nn.Module):
    """SwiGLU ``(silu(x @ w_gate) * (x @ w_up)) @ w_down``: x [B, T, D] -> [B, T, D]; ``w_gate_up``
    [D, 2F] (`fused_parts`, ``shards`` groups), ``w_down`` [F, D]. ``down_partials`` > 1: F split in
    that many parts, output f32 partial sums [splits, B, T, D] (`AddRMSNorm`)."""

    cfg: Any
    param_dtype: Any = jnp.float32
    down_partials: int = 1
    shards: int = 1
    quantization: str | None = None

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        D, F = self.cfg.hidden_size, self.cfg.intermediate_size
        parts = fused_parts(self.cfg, self.shards)["w_gate_up"]
        w_gate_up = declare_weight(self, "w_gate_up", (D, 2 * F))
        w_down = declare_weight(self, "w_down", (F, D))
        with jax.named_scope("mlp"):
            gu = dense(x, w_gate_up)                                    # [B, T, 2F]
            if self.shards > 1:                                         # [B, T, shards, 2F/shards]
                gu = gu.reshape(*gu.shape[:-1], self.shards, -1)
            h = jax.nn.silu(gu[..., parts["gate"]]) * gu[..., parts["up"]]
            h = h.reshape(*h.shape[:-2], F) if self.shards > 1 else h   # [B, T, F]
            splits = self.down_partials
            if splits > 1:
                B, T, F = h.shape
                w = w_down.value(x.dtype).reshape(splits, F // splits, -1)   # a view
                return jnp.einsum("btpf,pfd->pbtd", h.reshape(B, T, splits, F // splits), w,
                                  preferred_element_type=jnp.float32)
            return dense(h, w_down).astype(x.dtype)
