"""The experimental few-row GEMV kernel (interpret mode) against its float32 reference."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.gemv import reference, triton_pallas


@pytest.mark.parametrize("M, K, N, bn, bk, dtype", [
    (1, 512, 128, 32, 128, jnp.float32),
    (2, 256, 64, 32, 64, jnp.float32),
    (4, 1024, 256, 64, 256, jnp.bfloat16),
])
def test_interpret_matches_reference(M, K, N, bn, bk, dtype):
    kx, kw = jax.random.split(jax.random.key(M))
    x = jax.random.normal(kx, (M, K), jnp.float32).astype(dtype)
    w = jax.random.normal(kw, (K, N), jnp.float32).astype(dtype)
    got = triton_pallas.gemv(x, w, bn=bn, bk=bk, interpret=True)
    want = reference.gemv(x, w)
    assert got.shape == (M, N) and got.dtype == dtype
    # both accumulate in float32 (in another order): float32 ~1e-6 relative to the sum's size;
    # bf16 outputs: one rounding
    scale = float(jnp.sqrt(K * 1.0))
    tol = 1e-5 * scale if dtype == jnp.float32 else 2 ** -7 * scale
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                               rtol=0, atol=tol)
    # against float64 arithmetic written out
    ref64 = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
    np.testing.assert_allclose(np.asarray(want, np.float64), ref64, rtol=0, atol=tol)


@pytest.mark.parametrize("M, K, N, bn, bk, splits", [(1, 512, 64, 32, 64, 4), (2, 256, 64, 32, 32, 2)])
def test_split_over_k_gives_partial_sums(M, K, N, bn, bk, splits):
    """splits > 1: float32 partial sums [splits, M, N], part s = x[:, Ks] @ w[Ks, :] for the s-th
    K range, which add up to x @ w."""
    kx, kw = jax.random.split(jax.random.key(K))
    x = jax.random.normal(kx, (M, K), jnp.float32).astype(jnp.bfloat16)
    w = jax.random.normal(kw, (K, N), jnp.float32).astype(jnp.bfloat16)
    parts = triton_pallas.gemv(x, w, bn=bn, bk=bk, splits=splits, interpret=True)
    assert parts.shape == (splits, M, N) and parts.dtype == jnp.float32
    x64, w64 = np.asarray(x, np.float64), np.asarray(w, np.float64)
    Ks = K // splits
    tol = 1e-5 * np.sqrt(Ks)
    for s in range(splits):
        want = x64[:, s * Ks:(s + 1) * Ks] @ w64[s * Ks:(s + 1) * Ks]
        np.testing.assert_allclose(np.asarray(parts[s], np.float64), want, rtol=0, atol=tol)
    np.testing.assert_allclose(np.asarray(parts, np.float64).sum(0), x64 @ w64, rtol=0,
                               atol=tol * splits)


def test_bad_arguments_are_named():
    x, w = jnp.ones((2, 64)), jnp.ones((64, 32))
    with pytest.raises(ValueError, match="disagree on K"):
        reference.gemv(x, w[:32])
    with pytest.raises(ValueError, match=r"x must be \[M, K\]"):
        reference.gemv(x[None], w)
    for M in (3, 5):  # Triton block shapes are powers of 2
        with pytest.raises(ValueError, match=f"M={M} rows: must be 1, 2 or 4"):
            triton_pallas.gemv(jnp.ones((M, 64)), w, interpret=True)
    with pytest.raises(ValueError, match="bn=24 must be a power of 2 dividing N=32"):
        triton_pallas.gemv(x, w, bn=24, bk=32, interpret=True)
    with pytest.raises(ValueError, match="splits, num_warps and num_stages must be >= 1"):
        triton_pallas.gemv(x, w, splits=0, interpret=True)
    with pytest.raises(ValueError, match=r"splits \* bk = 3 \* 32 must divide K=64"):
        triton_pallas.gemv(x, w, bk=32, splits=3, interpret=True)
    for bad in (dict(bn=32.0), dict(bk=None), dict(bk=True), dict(splits=2.0)):
        with pytest.raises(ValueError, match="must be an integer"):
            triton_pallas.gemv(x, w, interpret=True, **bad)
    with pytest.raises(ValueError, match="K=0, N=32: both must be >= 1"):  # no crash in Pallas
        triton_pallas.gemv(jnp.ones((1, 0)), jnp.ones((0, 32)), interpret=True)
    parts = triton_pallas.gemv(x, w, bk=32, splits=np.int64(2), interpret=True)  # numpy ints
    assert parts.shape == (2, 2, 32)
    assert triton_pallas.supports(1, 4096, 4096) and not triton_pallas.supports(1, 4096, 4100)
    assert triton_pallas.supports(1, 4096, 4096, splits=8) and not triton_pallas.supports(
        1, 4096, 4096, bk=512, splits=16)
