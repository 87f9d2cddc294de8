"""The split combine kernel compiled on a CUDA GPU vs its plain-jnp reference (tier ``gpu``):
``python3 -m pytest -m gpu tests/kernels/test_split_combine_gpu.py -q -p no:cacheprovider``."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.paged_attention import split_combine

from .test_split_combine import CASES, split_attention

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a CUDA GPU"),
]


@pytest.mark.parametrize("B, K, G, Gp, H, S", CASES + [(64, 8, 4, 8, 128, 4)])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_compiled_matches_reference(B, K, G, Gp, H, S, dtype):
    o, lse, exact = split_attention(2, B=B, K=K, G=G, Gp=Gp, H=H, S=S, keys_per_split=6,
                                    empty=[(0, S - 1)])
    want = split_combine.reference(o, lse, num_heads=K * G, out_dtype=dtype)
    got = split_combine.combine(o, lse, num_heads=K * G, out_dtype=dtype)
    # exp on the GPU may differ from XLA's in the last float32 bits; in bf16, one ulp (2^-7)
    tol = 1e-5 if dtype == jnp.float32 else 2 ** -7
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                               rtol=tol, atol=tol)
    np.testing.assert_allclose(np.asarray(got, np.float32), exact, rtol=2e-2, atol=2e-2)
