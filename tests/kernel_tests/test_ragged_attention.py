"""Ragged paged attention (`pallas_kernels.paged_attention.ragged`): the token-by-token reference
against a float64 numpy loop, and the tiled form (with the jnp reference and with the Triton
prefill kernel on its tiles) against the reference; interpret mode on the CPU, compiled on a
GPU (``-m gpu``). Rows mix decode (1 token), chunk continuations and whole prompts; lengths cross
page edges; padded rows and padded tokens follow the real ones."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.paged_attention import prefill_triton, ragged, reference

from .modes import MODES

PAGE = 16


def _case(rng, q_lens, kv_lens, T, R, N=4, K=2, H=32, P=64, M=8, dtype=jnp.float32):
    """Random pools and a ragged batch of rows (q_len, kv_len), padded to T tokens, R rows."""
    k_pool = rng.standard_normal((2, P, K, PAGE, H)).astype(np.float32)
    v_pool = rng.standard_normal((2, P, K, PAGE, H)).astype(np.float32)
    qsl = np.full((R + 1,), sum(q_lens), np.int32)
    qsl[: len(q_lens) + 1] = np.concatenate([[0], np.cumsum(q_lens)])
    seq_lens = np.zeros((R,), np.int32)
    seq_lens[: len(kv_lens)] = kv_lens
    tables = np.zeros((R, M), np.int32)
    pages = rng.permutation(np.arange(1, P))  # page 0: the null page
    for r, n in enumerate(kv_lens):
        need = -(-n // PAGE)
        tables[r, :need], pages = pages[:need], pages[need:]
    q = rng.standard_normal((T, N, H)).astype(np.float32)
    arrays = q, k_pool, v_pool, tables, seq_lens, qsl
    return tuple(jnp.asarray(a, dtype) if a.dtype == np.float32 else jnp.asarray(a) for a in arrays)


def _numpy_oracle(q, k_pool, v_pool, tables, seq_lens, qsl, layer, scale):
    """float64, one query token at a time."""
    q, k_pool, v_pool = (np.asarray(a, np.float64) for a in (q, k_pool, v_pool))
    tables, seq_lens, qsl = (np.asarray(a) for a in (tables, seq_lens, qsl))
    T, N, H = q.shape
    G = N // k_pool.shape[2]
    out = np.zeros_like(q)
    for r in range(len(seq_lens)):
        n = qsl[r + 1] - qsl[r]
        for i in range(n):
            t, pos = qsl[r] + i, seq_lens[r] - n + i
            keys = np.arange(pos + 1)
            pg, off = tables[r, keys // PAGE], keys % PAGE
            for h in range(N):
                k = k_pool[layer, pg, h // G, off]  # [S, H]
                v = v_pool[layer, pg, h // G, off]
                s = k @ q[t, h] * scale
                p = np.exp(s - s.max())
                out[t, h] = p @ v / p.sum()
    return out, qsl[-1]


CASES = [  # (q_lens, kv_lens): decode rows, a continuing chunk, a whole prompt
    ([1, 1, 17, 40], [33, 16, 49, 40]),
    ([1], [1]),
    ([15, 1, 16, 2], [15, 64, 47, 18]),
]


@pytest.mark.parametrize("q_lens, kv_lens", CASES)
def test_reference_matches_numpy(q_lens, kv_lens):
    rng = np.random.default_rng(0)
    args = _case(rng, q_lens, kv_lens, T=sum(q_lens) + 5, R=len(q_lens) + 2)
    out = reference.ragged_paged_attention(*args, layer=1, scale=0.3)
    want, used = _numpy_oracle(*args, layer=1, scale=0.3)
    np.testing.assert_allclose(np.asarray(out)[:used], want[:used], rtol=2e-5, atol=2e-5)
    assert not np.asarray(out)[used:].any()  # padded tokens: zeros


@pytest.mark.parametrize("block_q", [1, 4, 16])
@pytest.mark.parametrize("q_lens, kv_lens", CASES)
def test_tiles_match_reference(q_lens, kv_lens, block_q):
    rng = np.random.default_rng(1)
    args = _case(rng, q_lens, kv_lens, T=sum(q_lens) + 3, R=len(q_lens) + 1)
    used = sum(q_lens)
    want = reference.ragged_paged_attention(*args, layer=0, scale=0.25)
    out = ragged.ragged_paged_attention(*args, layer=0, scale=0.25, block_q=block_q)
    np.testing.assert_allclose(
        np.asarray(out)[:used], np.asarray(want)[:used], rtol=1e-5, atol=1e-5
    )


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("q_lens, kv_lens", CASES[:1] + CASES[2:])
def test_triton_tiles_match_reference(mode, q_lens, kv_lens):
    rng = np.random.default_rng(2)
    dtype = jnp.float32 if mode == "interpret" else jnp.bfloat16
    args = _case(rng, q_lens, kv_lens, T=64, R=8, dtype=dtype)
    used = sum(q_lens)
    kernel = functools.partial(
        prefill_triton.paged_prefill_attention, interpret=mode == "interpret"
    )
    fn = jax.jit(
        functools.partial(ragged.ragged_paged_attention, attention=kernel, scale=0.25, block_q=16)
    )
    out = np.asarray(fn(*args, layer=jnp.int32(1)), np.float32)[:used]
    f32 = [a.astype(jnp.float32) if a.dtype == dtype else a for a in args]
    want = np.asarray(reference.ragged_paged_attention(*f32, layer=1, scale=0.25))[:used]
    err = np.linalg.norm(out - want) / np.linalg.norm(want)
    assert err < (1e-5 if mode == "interpret" else 1e-2), err
