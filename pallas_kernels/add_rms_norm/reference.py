"""Plain-jnp fused residual add + RMSNorm: x [S, D], delta [S, D] -> x' = x + delta (in x.dtype)
-> h = weight * (x' / sqrt(mean(x'^2) + eps)) -> (x', h). HF ``LlamaRMSNorm`` numerics: f32
statistics, normalized value rounded to x.dtype before the weight multiply, weight cast to x.dtype.
Sources: Zhang & Sennrich 2019 (RMSNorm); vLLM ``fused_add_rms_norm`` (layernorm_kernels.cu)."""

import numbers

import jax
import jax.numpy as jnp


def check_args(x: jax.Array, delta: jax.Array | None, weight: jax.Array,
               eps: float = 1e-6) -> tuple[int, int]:
    """Validate shapes, dtypes and eps -> (S, D); ValueError names the argument and its value."""
    if x.ndim != 2:
        raise ValueError(f"x must be [S, D]; got shape {x.shape}")
    S, D = x.shape
    if delta is not None and (delta.shape != x.shape or delta.dtype != x.dtype):
        raise ValueError(f"delta must match x ({x.dtype}{list(x.shape)}); got "
                         f"{delta.dtype}{list(delta.shape)}")
    if weight.shape != (D,):
        raise ValueError(f"weight must be [D={D}]; got shape {weight.shape}")
    for name, a in (("x", x), ("weight", weight)):
        if not jnp.issubdtype(a.dtype, jnp.floating):
            raise ValueError(f"{name} must be a floating dtype; got {a.dtype}")
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real) or not eps >= 0:
        raise ValueError(f"eps must be a number >= 0; got {eps!r}")
    return S, D


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """RMSNorm over the last axis with HF's numerics (module docstring), in x.dtype."""
    xf = x.astype(jnp.float32)
    var = jnp.mean(jnp.square(xf), axis=-1, keepdims=True)
    normed = (xf * jax.lax.rsqrt(var + eps)).astype(x.dtype)
    return (weight.astype(x.dtype) * normed).astype(x.dtype)


def add_rms_norm(x: jax.Array, delta: jax.Array | None, weight: jax.Array, *,
                 eps: float = 1e-6) -> tuple[jax.Array, jax.Array]:
    """Residual add then RMSNorm -> (x' [S, D], h [S, D]) in x.dtype. delta: [S, D] in x.dtype,
    or None (x' = x). ValueError: `check_args`."""
    check_args(x, delta, weight, eps)
    if delta is not None:
        x = (x + delta).astype(x.dtype)
    return x, rms_norm(x, weight, eps)
