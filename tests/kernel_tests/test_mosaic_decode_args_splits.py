"""Mosaic GPU paged decode attention without running the kernel: its argument checks (ValueError
naming the bad value), the split count `_pick_splits` chooses, and the jnp split combine against
a float32 softmax over all keys. The kernel against the reference: test_mosaic_decode.py."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.paged_attention import mosaic


def _shapes(B=2, N=4, K=2, H=64, page=16, M=3, L=2, dtype=jnp.bfloat16):
    """Zero inputs (q, k_pool, v_pool, tables, lens) of these sizes, to reach the checks."""
    return (
        jnp.zeros((B, N, H), dtype),
        jnp.zeros((L, 8, K, page, H), dtype),
        jnp.zeros((L, 8, K, page, H), dtype),
        jnp.zeros((B, M), jnp.int32),
        jnp.zeros((B,), jnp.int32),
    )


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(page_offset=np.zeros(32, np.float32)), r"page_offset must be i32\[32\]"),
        (dict(page_offset=[0] * 32), r"page_offset must be i32\[32\]"),
        (dict(layer=2), "layer=2 is outside the pools' L=2 layers"),
        (dict(layer=-1), "layer=-1 is outside"),
    ],
)
def test_bad_layer_or_offset_raises(kw, match):
    with pytest.raises(ValueError, match=match):
        mosaic.paged_decode_attention(*_shapes(), scale=0.1, **kw)


def test_bad_q_raises():
    q, k, v, t, s = _shapes()
    with pytest.raises(ValueError, match=r"q must be \[B, N, H\]"):
        mosaic.paged_decode_attention(q[:, None], k, v, t, s, scale=0.1)
    with pytest.raises(ValueError, match="q must be a floating dtype"):
        mosaic.paged_decode_attention(q.astype(jnp.int32), k, v, t, s, scale=0.1)
    q, k, v, t, s = _shapes(B=0)
    with pytest.raises(ValueError, match="B=0 rows"):
        mosaic.paged_decode_attention(q, k, v, t, s, scale=0.1)


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(N=3), "multiple of num KV heads"),
        (dict(H=96), "multiple of 64"),
        (dict(page=12), "page_size=12"),
        (dict(dtype=jnp.float32), "float32 only in interpret"),
    ],
)
def test_bad_shapes_raise(kw, match):
    with pytest.raises(ValueError, match=match):
        mosaic.paged_decode_attention(*_shapes(**kw), scale=0.1)


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(block_kv=48), "block_kv=48"),
        (dict(num_stages=0), "num_stages=0"),
        (dict(num_splits=0), "num_splits=0"),
        (dict(sliding_window=0), "sliding_window=0"),
        (dict(soft_cap=-1.0), "soft_cap=-1.0"),
    ],
)
def test_bad_knobs_raise(kw, match):
    with pytest.raises(ValueError, match=match):
        mosaic.paged_decode_attention(*_shapes(), scale=0.1, **kw)


@pytest.mark.parametrize(
    "rows, max_blocks, expected",
    [
        (8, 16, 8),  # B=1, 8 KV heads, 1024 keys: 2 blocks per split, not 16 one-block splits
        (8, 1, 1),  # a single block: no split
        (8, 3, 1),
        (2048, 16, 2),  # B=256: 2 splits give 10.3 resident waves, 94% of the last one busy
        (64, 512, 12),  # B=8, 32768 keys: the wave rule, far under the cap
    ],
)
def test_pick_splits_waves_and_two_block_cap(rows, max_blocks, expected):
    cfg = mosaic.MosaicDecodeConfig(num_sms=132)
    smem = 70 * 1024  # 3 programs resident per multiprocessor
    got = mosaic._pick_splits(cfg, rows, max_blocks, smem)
    assert got == expected
    assert got <= max(1, max_blocks // 2)
    fixed = mosaic.MosaicDecodeConfig(num_splits=5)
    assert mosaic._pick_splits(fixed, rows, max_blocks, smem) == min(5, max_blocks)


def split_attention(seed, *, B, K, G, Gp, H, S, keys_per_split, empty=()):
    """Random scores and values cut into S splits: (o, lse) as the split kernel writes them, and
    the exact float32 attention output [B, K*G, H] over all keys."""
    rng = np.random.default_rng(seed)
    T = S * keys_per_split
    scores = rng.standard_normal((B, K, Gp, T)) * 3.0
    v = rng.standard_normal((B, K, T, H))
    valid = np.ones((B, K, Gp, T), bool)
    for b, s in empty:  # split s of row b has no key
        valid[b, :, :, s * keys_per_split : (s + 1) * keys_per_split] = False
    sc = np.where(valid, scores, -np.inf)
    o = np.zeros((B, K, S, Gp, H))
    lse = np.full((B, K, S, Gp), -np.inf)
    for s in range(S):
        part = sc[..., s * keys_per_split : (s + 1) * keys_per_split]
        m = part.max(-1, keepdims=True)
        m = np.where(np.isfinite(m), m, 0.0)
        e = np.exp(part - m)
        den = e.sum(-1)
        vs = v[:, :, s * keys_per_split : (s + 1) * keys_per_split]
        o[:, :, s] = np.einsum("bkgt,bkth->bkgh", e, vs) / np.where(den > 0, den, 1)[..., None]
        lse[:, :, s] = np.where(den > 0, m[..., 0] + np.log(np.where(den > 0, den, 1)), -np.inf)
    m = sc.max(-1, keepdims=True)
    e = np.exp(sc - np.where(np.isfinite(m), m, 0))
    exact = np.einsum("bkgt,bkth->bkgh", e, v) / e.sum(-1)[..., None]
    exact = exact[:, :, :G].reshape(B, K * G, H)
    return jnp.asarray(o, jnp.float32), jnp.asarray(lse, jnp.float32), exact


@pytest.mark.parametrize(
    "B, K, G, Gp, H, S",
    [
        (1, 8, 4, 8, 128, 8),  # Qwen3-8B at B=1, context 1024 (8 splits of 2 blocks)
        (3, 2, 2, 8, 64, 3),  # S not a power of 2
        (2, 1, 8, 8, 32, 5),  # G = Gp: no padding rows
        (2, 2, 1, 8, 64, 2),
    ],
)
def test_combine_splits_is_exact_attention(B, K, G, Gp, H, S):
    """The jnp split combine against a float32 softmax over all the keys at once (an independent
    check of the log-sum-exp arithmetic); an empty split weighs nothing, all empty gives zeros."""
    o, lse, exact = split_attention(
        0, B=B, K=K, G=G, Gp=Gp, H=H, S=S, keys_per_split=5, empty=[(0, S - 1)]
    )
    got = mosaic.combine_splits(o, lse, num_heads=K * G, out_dtype=jnp.float32)
    np.testing.assert_allclose(np.asarray(got), exact, rtol=1e-5, atol=1e-5)
    empty = mosaic.combine_splits(
        o * 0, jnp.full_like(lse, -jnp.inf), num_heads=K * G, out_dtype=jnp.bfloat16
    )
    assert empty.dtype == jnp.bfloat16 and np.all(np.asarray(empty, np.float32) == 0)
