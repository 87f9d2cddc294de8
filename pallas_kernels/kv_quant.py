"""fp8 (e4m3) KV pages: a K or V value ``x`` is stored as ``clip(x / scale, -448, 448)`` in
float8_e4m3fn and read back as ``stored.astype(f32) * scale``, one f32 scale per (layer, KV head)
(``k_scale``, ``v_scale`` f32[L, K]); other pools store ``x`` as it is. Source: vLLM's
``kv_cache_dtype="fp8"``; Micikevicius et al. 2022 (FP8 formats, e4m3 max 448)."""

import jax
import jax.numpy as jnp

FP8 = jnp.dtype(jnp.float8_e4m3fn)
FP8_MAX = 448.0  # largest finite float8_e4m3fn


def is_fp8(dtype) -> bool:
    """Whether pages of ``dtype`` are stored as fp8 (and so carry scales)."""
    return jnp.dtype(dtype) == FP8


def quantize(x: jax.Array, scale: jax.Array | None, dtype) -> jax.Array:
    """``x`` stored in a pool of ``dtype``: fp8: ``clip(x.astype(f32) / scale, -448, 448)`` as e4m3
    (``scale`` broadcast); else ``x.astype(dtype)``. ValueError: fp8 without ``scale``."""
    if not is_fp8(dtype):
        return x.astype(dtype)
    if scale is None:
        raise ValueError("an fp8 KV pool needs its k_scale / v_scale; got scale=None")
    return jnp.clip(x.astype(jnp.float32) / scale, -FP8_MAX, FP8_MAX).astype(FP8)


def check_scales(k_pool: jax.Array, k_scale: jax.Array | None, v_scale: jax.Array | None) -> None:
    """ValueError naming the argument unless the scales are None or f32[L, K], both given if fp8."""
    L, K = k_pool.shape[0], k_pool.shape[2]
    for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        if s is None and is_fp8(k_pool.dtype):
            raise ValueError(f"{name}=None: fp8 KV pools need per-head scales f32[L={L}, K={K}]")
        if s is not None and tuple(s.shape) != (L, K):
            raise ValueError(f"{name} must be f32[L={L}, K={K}]; got shape {tuple(s.shape)}")
