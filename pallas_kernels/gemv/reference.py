"""Plain-jnp reference of the few-row matrix product ``y = x @ w`` (float32 accumulation).

    x [M, K], w [K, N] -> y [M, N] in ``out_dtype`` (default x.dtype).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def check_args(x: jax.Array, w: jax.Array) -> tuple[int, int, int]:
    """Validate shapes and dtypes; return (M, K, N).

    Raises:
        ValueError: naming the argument, its shape or dtype, and what is allowed.
    """
    if x.ndim != 2 or w.ndim != 2:
        raise ValueError(f"x must be [M, K] and w [K, N]; got shapes {x.shape} and {w.shape}")
    if x.shape[1] != w.shape[0]:
        raise ValueError(f"x [M, K={x.shape[1]}] and w [K={w.shape[0]}, N] disagree on K")
    for name, a in (("x", x), ("w", w)):
        if not jnp.issubdtype(a.dtype, jnp.floating):
            raise ValueError(f"{name} must be a floating dtype; got {a.dtype}")
    return x.shape[0], x.shape[1], w.shape[1]


def gemv(x: jax.Array, w: jax.Array, *, out_dtype=None) -> jax.Array:
    """``x @ w`` with float32 accumulation, cast to ``out_dtype`` (default x.dtype).

    Args:
        x: [M, K] float.
        w: [K, N] float (cast to float32 with x).
    Returns:
        [M, N] in ``out_dtype``.
    Raises:
        ValueError: see `check_args`.
    """
    check_args(x, w)
    y = jnp.dot(x.astype(jnp.float32), w.astype(jnp.float32),
                precision=jax.lax.Precision.HIGHEST)
    return y.astype(out_dtype or x.dtype)
