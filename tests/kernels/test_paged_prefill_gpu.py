"""Paged prefill attention compiled on a CUDA GPU vs the float32 reference (tier ``gpu``).

Run on the device machine: ``python3 -m pytest -m gpu tests/kernels -q -p no:cacheprovider``.
Same case table as the CPU tier (tests/kernels/test_paged_prefill.py), plus a Qwen3-8B-shaped bf16
batch (32/8 heads, H=128, page 16: chunks continuing cached prefixes) under several tile settings.
Compiled outputs cannot be pre-filled with NaN, so every element is checked finite and matched.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.paged_attention import prefill_triton, reference

from .test_paged_prefill import CASES, TOL, make_case

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a CUDA GPU"),
]


def _check(out, args, kwargs, dtype):
    q, k_pool, v_pool, bt, seq_lens, q_positions = args
    with jax.default_matmul_precision("highest"):
        ref = reference.paged_attention(q.astype(jnp.float32), k_pool.astype(jnp.float32),
                                        v_pool.astype(jnp.float32), bt, seq_lens, q_positions,
                                        **kwargs)
    out, ref = np.asarray(out.astype(jnp.float32)), np.asarray(ref)
    assert out.shape == ref.shape
    assert np.all(np.isfinite(out))
    assert np.all(out[np.asarray(seq_lens) == 0] == 0)
    tol = TOL[dtype]
    rel = np.linalg.norm(out - ref) / np.linalg.norm(ref)
    assert rel < tol, f"relative error {rel:.2e} >= {tol}"
    np.testing.assert_allclose(out, ref, rtol=tol, atol=tol * 4)


@pytest.mark.parametrize("name", sorted(CASES))
def test_compiled_vs_reference(name):
    args, kwargs, knobs, dtype = make_case(name, seed=10)
    out = prefill_triton.paged_prefill_attention(*args, **kwargs, **knobs)
    assert out.dtype == args[0].dtype
    _check(out, args, kwargs, dtype)


@pytest.mark.parametrize("knobs", [{}, dict(block_q=32, pages_per_block=4, num_warps=8),
                                   dict(block_q=16, pages_per_block=8, num_warps=4, num_stages=3)])
def test_qwen3_shape_bf16(knobs):
    rng = np.random.default_rng(12)
    N, K, H, ps, M = 32, 8, 128, 16, 40
    rows = [(300, 256), (256, 256), (0, 0), (613, 77)]          # (seq_len, chunk length)
    B, T = len(rows), 256
    P = B * M + 1
    tables = (1 + rng.permutation(B * M)).reshape(B, M).astype(np.int32)
    pos = np.zeros((B, T), np.int32)
    for b, (s, n) in enumerate(rows):
        pos[b, :n] = np.arange(s - n, s)
    args = (jnp.asarray(rng.standard_normal((B, T, N, H)), jnp.bfloat16),
            jnp.asarray(rng.standard_normal((2, P, K, ps, H)), jnp.bfloat16),
            jnp.asarray(rng.standard_normal((2, P, K, ps, H)), jnp.bfloat16),
            jnp.asarray(tables), jnp.asarray([s for s, _ in rows], jnp.int32), jnp.asarray(pos))
    kwargs = dict(layer=1, scale=H ** -0.5)
    _check(prefill_triton.paged_prefill_attention(*args, **kwargs, **knobs), args, kwargs,
           "bfloat16")
