"""The experimental few-row GEMV kernel (interpret mode) against its float32 reference."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.gemv import reference, triton_pallas


@pytest.mark.parametrize("M, K, N, bn, bk, dtype", [
    (1, 512, 128, 32, 128, jnp.float32),
    (3, 256, 64, 32, 64, jnp.float32),
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


def test_bad_arguments_are_named():
    x, w = jnp.ones((2, 64)), jnp.ones((64, 32))
    with pytest.raises(ValueError, match="disagree on K"):
        reference.gemv(x, w[:32])
    with pytest.raises(ValueError, match=r"x must be \[M, K\]"):
        reference.gemv(x[None], w)
    with pytest.raises(ValueError, match=r"M=5 must be in \[1, 4\]"):
        triton_pallas.gemv(jnp.ones((5, 64)), w, interpret=True)
    with pytest.raises(ValueError, match="bn=24"):
        triton_pallas.gemv(x, w, bn=24, bk=32, interpret=True)
    assert triton_pallas.supports(1, 4096, 4096) and not triton_pallas.supports(1, 4096, 4100)
