"""Plain-jnp attention prologue of a Llama/Qwen3 layer: qkv [S, (N + 2K) * H] -> per-head RMSNorm of
the query and key heads (Qwen3) -> RoPE (HF ``rotate_half``) -> K/V written into the page pools at
each token's slot -> q [S, N, H]. HF numerics: RMSNorm statistics in f32, the normalized value
rounded to the compute dtype before the weight multiply, RoPE in f32, results in the compute dtype;
K/V cast to the pools' dtype (fp8: `kv_quant.quantize`). Sources: Zhang & Sennrich 2019 (RMSNorm);
Su et al. 2021 (RoPE); Qwen Team 2025 (QK-Norm); Kwon et al. 2023 (paged KV, slot mapping)."""

import jax
import jax.numpy as jnp

from pallas_kernels.add_rms_norm.reference import rms_norm
from pallas_kernels.kv_quant import check_scales, quantize
from pallas_kernels.paged_attention.reference import check_pools
from pallas_kernels.sizes import raise_first


def check_args(qkv, q_norm, k_norm, cos, sin, slot_mapping, k_pool, v_pool, num_heads: int,
               num_kv_heads: int) -> tuple[int, int, int, int]:
    """Validate shapes -> (S, N, K, H); ValueError names the argument, its shape and the rule."""
    N, K, H = num_heads, num_kv_heads, check_pools(k_pool, v_pool)[4]
    if k_pool.shape[2] != K:
        raise ValueError(f"the pools have {k_pool.shape[2]} KV heads, num_kv_heads={K}")
    if H % 2:
        raise ValueError(f"head dim H={H} must be even (RoPE pairs i with i + H/2)")
    if qkv.ndim != 2 or qkv.shape[1] != (N + 2 * K) * H:
        raise ValueError(f"qkv must be [S, (N + 2K) * H] = [S, {(N + 2 * K) * H}]; got {qkv.shape}")
    S = qkv.shape[0]
    raise_first([
        *[(a.shape != (S, H // 2), f"{name} must be f32[S, H/2] = [{S}, {H // 2}]; got {a.shape}")
          for name, a in (("cos", cos), ("sin", sin))],
        (slot_mapping.shape != (S,) or not jnp.issubdtype(slot_mapping.dtype, jnp.integer),
         f"slot_mapping must be i32[S={S}]; got {slot_mapping.dtype}{list(slot_mapping.shape)}"),
        *[(not jnp.issubdtype(a.dtype, jnp.floating), f"{name} must be a floating dtype; got "
           f"{a.dtype}") for name, a in (("qkv", qkv), ("cos", cos), ("sin", sin),
                                         ("k_pool", k_pool))],
        ((q_norm is None) != (k_norm is None),
         "q_norm and k_norm must be given together (Qwen3) or both None (Llama)"),
        *[(w is not None and w.shape != (H,), f"{name} must be [H={H}]; got "
           f"{getattr(w, 'shape', None)}") for name, w in (("q_norm", q_norm), ("k_norm", k_norm))],
        (N % K, f"num_heads={N} must be a multiple of num_kv_heads={K}")])
    return S, N, K, H


def rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """HF ``rotate_half`` RoPE of x [..., heads, H] (i pairs with i + H/2: ``(x1, x2) -> (x1 cos -
    x2 sin, x2 cos + x1 sin)``) in f32, returned in x.dtype; cos, sin f32[..., H/2] (all heads)."""
    xf = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    x1, x2 = xf[..., :half], xf[..., half:]
    c, s = cos[..., None, :], sin[..., None, :]
    return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).astype(x.dtype)


def write_kv(k_pool: jax.Array, v_pool: jax.Array, layer, k: jax.Array, v: jax.Array,
             slot_mapping: jax.Array, k_scale: jax.Array | None = None,
             v_scale: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """Scatter k, v [S, K, H] into ``layer`` of pools [L, P, K, page_size, H] at ``slot_mapping``
    i32[S] (``page * page_size + offset``; fp8: `kv_quant.quantize` by ``k_scale``, ``v_scale``
    f32[L, K]) -> new pools. Out-of-range slots or layer: undefined writes."""
    page, off = jnp.divmod(slot_mapping, k_pool.shape[3])  # shape[3]: page_size
    ks, vs = (None if x is None else x[layer][None, :, None] for x in (k_scale, v_scale))
    k_pool = k_pool.at[layer, page, :, off, :].set(quantize(k, ks, k_pool.dtype),
                                                   mode="promise_in_bounds")
    v_pool = v_pool.at[layer, page, :, off, :].set(quantize(v, vs, v_pool.dtype),
                                                   mode="promise_in_bounds")
    return k_pool, v_pool


def qkv_prologue(qkv: jax.Array, q_norm: jax.Array | None, k_norm: jax.Array | None,
                 cos: jax.Array, sin: jax.Array, slot_mapping: jax.Array, k_pool: jax.Array,
                 v_pool: jax.Array, *, layer, num_heads: int, num_kv_heads: int, eps: float = 1e-6,
                 k_scale: jax.Array | None = None, v_scale: jax.Array | None = None
                 ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The attention prologue of one layer in jnp -> (q, k_pool, v_pool), this step's K/V written at
    ``layer``; q [S, N, H] in qkv.dtype. qkv: [S, (N + 2K) * H] fused
    q/k/v projection, compute dtype. q_norm, k_norm: [H] RMSNorm weights (Qwen3), or both None
    (Llama). cos, sin: f32[S, H/2] at each token's position. slot_mapping, k_pool, v_pool, layer,
    k_scale, v_scale: as `write_kv` (unchecked ranges). ValueError: `check_args`, `check_scales`."""
    S, N, K, H = check_args(qkv, q_norm, k_norm, cos, sin, slot_mapping, k_pool, v_pool,
                            num_heads, num_kv_heads)
    check_scales(k_pool, k_scale, v_scale)
    qk = qkv[:, :(N + K) * H].reshape(S, N + K, H)
    v = qkv[:, (N + K) * H:].reshape(S, K, H)
    if q_norm is not None:  # one RMSNorm over the N + K heads, the weights broadcast
        w = jnp.concatenate([jnp.broadcast_to(q_norm, (N, H)), jnp.broadcast_to(k_norm, (K, H))])
        qk = rms_norm(qk, w, eps)
    with jax.named_scope("rope"):
        qk = rope(qk, cos.astype(jnp.float32), sin.astype(jnp.float32))
    with jax.named_scope("kv_write"):
        k_pool, v_pool = write_kv(k_pool, v_pool, layer, qk[:, N:], v, slot_mapping,
                                  k_scale, v_scale)
    return qk[:, :N], k_pool, v_pool
