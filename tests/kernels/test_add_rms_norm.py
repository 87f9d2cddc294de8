"""The fused residual add + RMSNorm: the Pallas kernel against the plain-jnp reference in two modes
(`modes.py`: interpret on the CPU, compiled on a CUDA GPU with ``-m gpu``), and the reference
against its own rms_norm (the model runs the reference on its xla path, which the model tests
check against HF transformers)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.add_rms_norm import reference, triton_pallas
from pallas_kernels.add_rms_norm.reference import rms_norm

from .modes import runs


def make_inputs(seed, *, S, D, dtype=jnp.float32, scale=3.0):
    ks = jax.random.split(jax.random.key(seed), 3)
    x = (scale * jax.random.normal(ks[0], (S, D), jnp.float32)).astype(dtype)
    d = jax.random.normal(ks[1], (S, D), jnp.float32).astype(dtype)
    w = (1.0 + 0.2 * jax.random.normal(ks[2], (D,))).astype(dtype)
    return x, d, w


CASES = [  # (S, D, dtype, with delta)
    (1, 64, jnp.float32, True),
    (7, 128, jnp.float32, True),
    (3, 32, jnp.float32, False),
    (5, 256, jnp.bfloat16, True),
    (2, 64, jnp.bfloat16, False),
]
QWEN3_8B = [(S, 4096, jnp.bfloat16, True) for S in (1, 256, 8192)]   # decode, packed prefill


@pytest.mark.parametrize("mode, case", runs(CASES, QWEN3_8B))
def test_kernel_matches_reference(mode, case):
    S, D, dtype, with_delta = case
    x, d, w = make_inputs(S, S=S, D=D, dtype=dtype)
    d = d if with_delta else None
    xr, hr = reference.add_rms_norm(x, d, w, eps=1e-5)
    xk, hk = triton_pallas.add_rms_norm(x, d, w, eps=1e-5, interpret=mode == "interpret")
    assert xk.dtype == hk.dtype == dtype and xk.shape == hk.shape == (S, D)
    # The sum x + delta is the same rounding on both sides; the norm may differ in the order of
    # its float32 sum (and, compiled, in the GPU's rsqrt), i.e. by one rounding of the dtype.
    np.testing.assert_array_equal(np.asarray(xk, np.float32), np.asarray(xr, np.float32))
    f32_tol = 1e-6 if mode == "interpret" else 1e-5
    tol = f32_tol if dtype == jnp.float32 else 2 ** -7
    hk = np.asarray(hk, np.float32)
    assert np.all(np.isfinite(hk))
    np.testing.assert_allclose(hk, np.asarray(hr, np.float32), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_reference_is_the_models_add_then_norm(dtype):
    x, d, w = make_inputs(0, S=4, D=48, dtype=dtype)
    xr, hr = reference.add_rms_norm(x, d, w, eps=1e-6)
    np.testing.assert_array_equal(np.asarray(xr, np.float32), np.asarray(x + d, np.float32))
    np.testing.assert_array_equal(np.asarray(hr, np.float32),
                                  np.asarray(rms_norm(x + d, w, 1e-6), np.float32))
    # and against float64 arithmetic written out: h = w * x' / rms(x')
    x64 = np.asarray(xr, np.float64)
    want = np.asarray(w, np.float64) * x64 / np.sqrt((x64 ** 2).mean(-1, keepdims=True) + 1e-6)
    tol = 1e-5 if dtype == jnp.float32 else 2 ** -6
    np.testing.assert_allclose(np.asarray(hr, np.float64), want, rtol=tol, atol=tol)


def test_bad_arguments_are_named():
    x, d, w = make_inputs(0, S=2, D=64)
    with pytest.raises(ValueError, match=r"x must be \[S, D\]"):
        reference.add_rms_norm(x[None], None, w)
    with pytest.raises(ValueError, match="delta must match x"):
        reference.add_rms_norm(x, d[:1], w)
    with pytest.raises(ValueError, match="delta must match x"):
        reference.add_rms_norm(x, d.astype(jnp.bfloat16), w)
    with pytest.raises(ValueError, match=r"weight must be \[D=64\]"):
        triton_pallas.add_rms_norm(x, d, w[:32], interpret=True)
    with pytest.raises(ValueError, match="power of 2"):
        triton_pallas.add_rms_norm(x[:, :48], d[:, :48], w[:48], interpret=True)
    assert triton_pallas.supports(4096) and not triton_pallas.supports(576)
    for eps in (None, -1e-6, "1e-6", True):
        with pytest.raises(ValueError, match="eps must be a number >= 0"):
            triton_pallas.add_rms_norm(x, d, w, eps=eps, interpret=True)
        with pytest.raises(ValueError, match="eps must be a number >= 0"):
            reference.add_rms_norm(x, d, w, eps=eps)
    for warps in (0, -1, 3, 64, 2.5, True, "16", "a"):
        with pytest.raises(ValueError, match="num_warps=.* must be None or a power-of-2"):
            triton_pallas.add_rms_norm(x, d, w, interpret=True, num_warps=warps)
    ref = reference.add_rms_norm(x, d, w)
    for warps in (None, 1, np.int64(16), 32):   # accepted (interpret mode ignores the count)
        got = triton_pallas.add_rms_norm(x, d, w, interpret=True, num_warps=warps)
        np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(ref[1]))


@pytest.mark.parametrize("with_delta", [True, False])
def test_zero_rows_like_the_reference(with_delta):
    """An empty batch of rows is valid input: empty outputs, as the reference gives, no launch."""
    x, d, w = make_inputs(1, S=0, D=64)
    d = d if with_delta else None
    got = triton_pallas.add_rms_norm(x, d, w, eps=np.float32(1e-6), interpret=True)
    want = reference.add_rms_norm(x, d, w)
    for g, r in zip(got, want):
        assert g.shape == r.shape == (0, 64) and g.dtype == r.dtype


def partial_sums(seed, P, S, D):
    """float32 partial sums [splits, S, D] of a split-K GEMM output (as `MLP` gives in decode)."""
    return 0.5 * jax.random.normal(jax.random.key(seed), (P, S, D), jnp.float32)


PARTIALS = [(2, 3, 64, jnp.bfloat16), (4, 5, 128, jnp.float32), (1, 2, 32, jnp.bfloat16)]
PARTIALS_QWEN3 = [(2, 1, 4096, jnp.bfloat16), (2, 192, 4096, jnp.bfloat16),
                  (4, 7, 4096, jnp.bfloat16)]   # the decode MLP's split down projection


@pytest.mark.parametrize("mode, case", runs(PARTIALS, PARTIALS_QWEN3))
def test_partial_sums_delta(mode, case):
    """delta as float32 partial sums: the reference adds their sum rounded to x.dtype (as a GEMM
    writes it), and the kernel gives the same x' and h."""
    P, S, D, dtype = case
    x, _, w = make_inputs(P + S, S=S, D=D, dtype=dtype)
    parts = partial_sums(P + S, P, S, D)
    xr, hr = reference.add_rms_norm(x, parts, w, eps=1e-6)
    xk, hk = triton_pallas.add_rms_norm(x, parts, w, eps=1e-6, interpret=mode == "interpret")
    # float32 sums of the partials in another order than float64's (or the GPU's): one rounding
    # of the dtype
    tol = 2e-6 if dtype == jnp.float32 else 2 ** -7
    if mode == "interpret":
        summed = np.asarray(parts, np.float64).sum(0).astype(np.float32)
        want = reference.add_rms_norm(x, jnp.asarray(summed).astype(dtype), w, eps=1e-6)
        pairs = [((xr, hr), want), ((xk, hk), want)]
    else:
        pairs = [((xk, hk), (xr, hr))]
    for got, ref in pairs:
        for g, r in zip(got, ref):
            np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(r, np.float32),
                                       rtol=tol, atol=tol)


def test_bad_partial_sums_are_named():
    x, _, w = make_inputs(0, S=2, D=64, dtype=jnp.bfloat16)
    parts = partial_sums(0, 2, 2, 64)
    with pytest.raises(ValueError, match=r"float32\[splits >= 1, S=2, D=64\]"):
        reference.add_rms_norm(x, parts.astype(jnp.bfloat16), w)
    with pytest.raises(ValueError, match=r"float32\[splits >= 1, S=2, D=64\]"):
        reference.add_rms_norm(x, parts[:, :1], w)
    with pytest.raises(ValueError, match="has 3 partial sums"):
        triton_pallas.add_rms_norm(x, partial_sums(0, 3, 2, 64), w, interpret=True)
