"""fp8-weight GEMM in plain jnp, float32: x [M, K] bf16, w [K, N] float8_e4m3fn, scale f32[N]
(per output channel) -> ``((x.f32 @ w.f32) * scale)`` as bf16 [M, N]; the same function as
`jaxinfer.models.layers.dense` with a per-channel fp8 `Weight`, up to where it rounds."""

import jax
import jax.numpy as jnp

from pallas_kernels.kv_quant import FP8
from pallas_kernels.sizes import raise_first


def check_args(x: jax.Array, w: jax.Array, scale: jax.Array) -> tuple[int, int, int]:
    """Validate shapes and dtypes -> (M, K, N); ValueError names the argument and its value."""
    if x.ndim != 2 or w.ndim != 2:
        raise ValueError(f"x must be [M, K] and w [K, N]; got shapes {x.shape} and {w.shape}")
    (M, K), N = x.shape, w.shape[1]
    raise_first([
        (w.shape[0] != K, f"w must be [K={K}, N]; got shape {w.shape}"),
        (w.dtype != FP8, f"w must be float8_e4m3fn; got {w.dtype}"),
        (scale.shape != (N,) or scale.dtype != jnp.float32,
         f"scale must be float32[N={N}]; got {scale.dtype}{list(scale.shape)}"),
        (x.dtype != jnp.bfloat16, f"x must be bfloat16; got {x.dtype}")])
    return M, K, N


def fp8_matmul(x: jax.Array, w: jax.Array, scale: jax.Array) -> jax.Array:
    """``(x.f32 @ w.f32) * scale`` at HIGHEST precision, rounded once to bf16 -> [M, N]."""
    check_args(x, w, scale)
    acc = jnp.dot(x.astype(jnp.float32), w.astype(jnp.float32),
                  precision=jax.lax.Precision.HIGHEST)
    return (acc * scale[None, :]).astype(jnp.bfloat16)
