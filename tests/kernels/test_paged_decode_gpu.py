"""Paged decode attention kernels compiled on a CUDA GPU vs the float32 reference (tier ``gpu``).

Run on the device machine: ``python3 -m pytest -m gpu tests/kernels -q -p no:cacheprovider``.
Same case table as the CPU tier (tests/kernels/test_paged_decode.py), for both Triton variants,
plus the tuned default knobs at a Qwen3-8B-like decode shape. Compiled outputs cannot be pre-filled
with NaN, so every element is checked finite and matched against the reference instead.
"""

from __future__ import annotations

import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.paged_attention import jax_triton_kernel, triton_pallas

from .test_paged_decode import CASES, check_against_reference, make_case

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a CUDA GPU"),
]

HAVE_JAX_TRITON = (importlib.util.find_spec("jax_triton") is not None
                   and importlib.util.find_spec("triton") is not None)
VARIANTS = {
    "triton": triton_pallas.paged_decode_attention,
    "jax_triton": pytest.param(
        jax_triton_kernel.paged_decode_attention,
        marks=pytest.mark.skipif(not HAVE_JAX_TRITON,
                                 reason="jax_triton/triton not importable (carry the wheels)")),
}


@pytest.mark.parametrize("fn", list(VARIANTS.values()), ids=list(VARIANTS))
@pytest.mark.parametrize("name", sorted(CASES))
def test_compiled_vs_reference(fn, name):
    args, kwargs, knobs, dtype = make_case(name, seed=10)
    out = fn(*args, **kwargs, **knobs)
    assert out.dtype == args[0].dtype
    check_against_reference(out, args, kwargs, dtype)


@pytest.mark.parametrize("fn", list(VARIANTS.values()), ids=list(VARIANTS))
def test_default_knobs_qwen3_shape(fn):
    """Tuned defaults (auto k_splits) at 32/8 heads, H=128, page 16, bf16, ragged long batch."""
    rng = np.random.default_rng(11)
    B, N, K, H, ps, M, L = 6, 32, 8, 128, 16, 40, 2
    P = B * M + 1
    seq_lens = np.array([640, 1, 0, 17, 333, 600], np.int32)
    pages = rng.permutation(np.arange(1, P))[:B * M].reshape(B, M).astype(np.int32)
    q = jnp.asarray(rng.standard_normal((B, N, H)), jnp.bfloat16)
    k_pool = jnp.asarray(rng.standard_normal((L, P, K, ps, H)), jnp.bfloat16)
    v_pool = jnp.asarray(rng.standard_normal((L, P, K, ps, H)), jnp.bfloat16)
    args = (q, k_pool, v_pool, jnp.asarray(pages), jnp.asarray(seq_lens))
    scale = H ** -0.5
    out = jax.jit(lambda *a: fn(*a[:5], layer=a[5], scale=scale))(*args, jnp.int32(1))  # traced
    check_against_reference(out, args, dict(layer=1, scale=scale), "bfloat16")
