"""The split (flash-decoding) combine kernel in interpret mode against its plain-jnp reference,
and the reference against a float32 softmax over all the keys at once (an independent check of
the log-sum-exp arithmetic)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.paged_attention import split_combine


def split_attention(seed, *, B, K, G, Gp, H, S, keys_per_split, empty=()):
    """Random scores and values cut into S splits: (o, lse) as a split kernel writes them, and
    the exact float32 attention output [B, K*G, H] over all keys."""
    rng = np.random.default_rng(seed)
    T = S * keys_per_split
    scores = rng.standard_normal((B, K, Gp, T)) * 3.0
    v = rng.standard_normal((B, K, T, H))
    valid = np.ones((B, K, Gp, T), bool)
    for b, s in empty:                                        # split s of row b has no key
        valid[b, :, :, s * keys_per_split:(s + 1) * keys_per_split] = False
    sc = np.where(valid, scores, -np.inf)
    o = np.zeros((B, K, S, Gp, H))
    lse = np.full((B, K, S, Gp), -np.inf)
    for s in range(S):
        part = sc[..., s * keys_per_split:(s + 1) * keys_per_split]
        m = part.max(-1, keepdims=True)
        m = np.where(np.isfinite(m), m, 0.0)
        e = np.exp(part - m)
        den = e.sum(-1)
        vs = v[:, :, s * keys_per_split:(s + 1) * keys_per_split]
        o[:, :, s] = (np.einsum("bkgt,bkth->bkgh", e, vs)
                      / np.where(den > 0, den, 1)[..., None])
        lse[:, :, s] = np.where(den > 0, m[..., 0] + np.log(np.where(den > 0, den, 1)), -np.inf)
    m = sc.max(-1, keepdims=True)
    e = np.exp(sc - np.where(np.isfinite(m), m, 0))
    exact = np.einsum("bkgt,bkth->bkgh", e, v) / e.sum(-1)[..., None]
    exact = exact[:, :, :G].reshape(B, K * G, H)
    return jnp.asarray(o, jnp.float32), jnp.asarray(lse, jnp.float32), exact


CASES = [  # B, K, G, Gp, H, S
    (1, 8, 4, 8, 128, 8),      # Qwen3-8B at B=1, context 1024 (8 splits of 2 blocks)
    (3, 2, 2, 8, 64, 3),       # S not a power of 2 (masked)
    (2, 1, 8, 8, 32, 5),       # G = Gp: no padding rows
    (2, 2, 1, 8, 64, 2),
]


@pytest.mark.parametrize("B, K, G, Gp, H, S", CASES)
def test_reference_is_exact_attention(B, K, G, Gp, H, S):
    o, lse, exact = split_attention(0, B=B, K=K, G=G, Gp=Gp, H=H, S=S, keys_per_split=5,
                                    empty=[(0, S - 1)])
    got = split_combine.reference(o, lse, num_heads=K * G, out_dtype=jnp.float32)
    np.testing.assert_allclose(np.asarray(got), exact, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("B, K, G, Gp, H, S", CASES)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_kernel_interpret_matches_reference(B, K, G, Gp, H, S, dtype):
    o, lse, _ = split_attention(1, B=B, K=K, G=G, Gp=Gp, H=H, S=S, keys_per_split=4,
                                empty=[(B - 1, 0)])
    want = split_combine.reference(o, lse, num_heads=K * G, out_dtype=dtype)
    got = split_combine.combine(o, lse, num_heads=K * G, out_dtype=dtype, interpret=True)
    assert got.shape == want.shape and got.dtype == want.dtype
    tol = 1e-6 if dtype == jnp.float32 else 2 ** -7
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                               rtol=tol, atol=tol)


def test_all_splits_empty_gives_zeros():
    o = jnp.ones((1, 2, 3, 8, 64), jnp.float32)
    lse = jnp.full((1, 2, 3, 8), -jnp.inf, jnp.float32)
    got = split_combine.combine(o * 0, lse, num_heads=4, out_dtype=jnp.float32, interpret=True)
    assert np.all(np.asarray(got) == 0)


@pytest.mark.parametrize("shape, num_heads, match", [
    (((1, 2, 3, 8, 64), (1, 2, 3, 7)), 4, "o must be"),
    (((1, 2, 3, 8, 64), (1, 2, 3, 8)), 3, "num_heads=3"),
    (((1, 2, 3, 8, 64), (1, 2, 3, 8)), 18, "num_heads=18"),
    (((1, 2, 3, 6, 64), (1, 2, 3, 6)), 4, "not supported"),
    (((1, 2, 64, 8, 128), (1, 2, 64, 8)), 4, "not supported"),
    (((1, 0, 3, 8, 64), (1, 0, 3, 8)), 4, "no empty axis"),
    (((0, 2, 3, 8, 64), (0, 2, 3, 8)), 4, "no empty axis"),
])
def test_bad_shapes_raise(shape, num_heads, match):
    o, lse = jnp.zeros(shape[0]), jnp.zeros(shape[1])
    with pytest.raises(ValueError, match=match):
        split_combine.combine(o, lse, num_heads=num_heads, out_dtype=jnp.float32, interpret=True)


def test_bad_out_dtype_raises():
    o, lse = jnp.zeros((1, 2, 3, 8, 64)), jnp.zeros((1, 2, 3, 8))
    for dt in (None, jnp.int32):
        with pytest.raises(ValueError, match="out_dtype must be a floating dtype"):
            split_combine.combine(o, lse, num_heads=4, out_dtype=dt, interpret=True)
