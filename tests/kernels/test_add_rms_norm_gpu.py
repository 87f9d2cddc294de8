"""The fused residual add + RMSNorm kernel compiled on a CUDA GPU vs the plain-jnp reference (tier
``gpu``): ``python3 -m pytest -m gpu tests/kernels/test_add_rms_norm_gpu.py -q -p no:cacheprovider``.

Cases: the CPU tier's table, plus Qwen3-8B's hidden size (4096) in bf16 at 1, 256 and 8192 rows
(decode and a packed prefill step).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.add_rms_norm import reference, triton_pallas

from .test_add_rms_norm import CASES, make_inputs

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a CUDA GPU"),
]

QWEN3_8B = [(S, 4096, jnp.bfloat16, True) for S in (1, 256, 8192)]


@pytest.mark.parametrize("S, D, dtype, with_delta", CASES + QWEN3_8B)
def test_compiled_matches_reference(S, D, dtype, with_delta):
    x, d, w = make_inputs(S, S=S, D=D, dtype=dtype)
    d = d if with_delta else None
    xr, hr = reference.add_rms_norm(x, d, w, eps=1e-6)
    xk, hk = triton_pallas.add_rms_norm(x, d, w, eps=1e-6)
    np.testing.assert_array_equal(np.asarray(xk, np.float32), np.asarray(xr, np.float32))
    # the GPU's rsqrt and sum order may differ from XLA's in the last float32 bits: at most one
    # rounding of the dtype after the cast
    tol = 1e-5 if dtype == jnp.float32 else 2 ** -7
    hk = np.asarray(hk, np.float32)
    assert np.all(np.isfinite(hk))
    np.testing.assert_allclose(hk, np.asarray(hr, np.float32), rtol=tol, atol=tol)


@pytest.mark.parametrize("P, S", [(2, 1), (2, 192), (4, 7)])
def test_compiled_partial_sums_match_reference(P, S):
    """delta as float32 partial sums (the decode MLP's split down projection), Qwen3-8B's D."""
    from .test_add_rms_norm import partial_sums
    x, _, w = make_inputs(S, S=S, D=4096, dtype=jnp.bfloat16)
    parts = partial_sums(S, P, S, 4096)
    xr, hr = reference.add_rms_norm(x, parts, w, eps=1e-6)
    xk, hk = triton_pallas.add_rms_norm(x, parts, w, eps=1e-6)
    # the partials' float32 sum order may differ (P > 2): one bf16 rounding
    np.testing.assert_allclose(np.asarray(xk, np.float32), np.asarray(xr, np.float32),
                               rtol=2 ** -7, atol=2 ** -7)
    np.testing.assert_allclose(np.asarray(hk, np.float32), np.asarray(hr, np.float32),
                               rtol=2 ** -7, atol=2 ** -7)
