"""Tests for jaxinfer.runner.rejection (the speculative-decoding verifier, Leviathan et al. 2023):
greedy rows against a numpy argmax chain, rows without drafts against `sample`, the emitted
tokens' distribution against numpy's filtered softmax (chi-square), determinism, shape errors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from sampling_refs import _sample, make_meta, np_filtered_probs

from jaxinfer.runner.rejection import verify

_verify = jax.jit(verify, static_argnames="all_greedy")
ALPHA = 0.001  # significance of each statistical test (fixed seeds: the outcome is reproducible)


def _meta(r, **kw):
    """`make_meta` at sampler level "sample": the penalty fields None."""
    return make_meta(r, **kw).replace(repetition_penalty=None, penalty_tokens=None)


def np_greedy(logits, drafts):
    """Plain numpy: accept drafts while each equals the argmax, then emit the argmax."""
    r, q, _ = logits.shape
    tokens, emitted = np.zeros((r, q), np.int32), np.zeros(r, np.int32)
    for i in range(r):
        j = 0
        while j < q - 1 and drafts[i, j] == np.argmax(logits[i, j]):
            tokens[i, j], j = drafts[i, j], j + 1
        tokens[i, j], emitted[i] = np.argmax(logits[i, j]), j + 1
    return tokens, emitted


def _greedy_case(rng, r=16, q=5, v=32):
    """Logits and drafts: each row's argmax chain for n_r drafts, broken at a random place in
    half of the rows; rows 0 and 1 without drafts."""
    logits = rng.standard_normal((r, q, v)).astype(np.float32)
    drafts = np.full((r, q), -1, np.int32)
    for i in range(2, r):
        n = rng.integers(1, q)
        drafts[i, :n] = np.argmax(logits[i, :n], axis=-1)
        if i % 2:
            j = rng.integers(0, n)
            drafts[i, j] = (drafts[i, j] + 1 + rng.integers(0, v - 1)) % v
    return logits, drafts


def test_greedy_matches_numpy_argmax_chain():
    rng = np.random.default_rng(0)
    logits, drafts = _greedy_case(rng)
    r = logits.shape[0]
    ref_t, ref_n = np_greedy(logits, drafts)
    assert 1 < len(set(ref_n.tolist())) and ref_n.max() > 2  # short and long accepted runs
    temperature = np.where(np.arange(r) % 3 == 0, np.nan, 0.0)  # NaN counts as greedy
    for all_greedy in (True, False):
        meta = _meta(r, temperature=temperature, top_k=4, top_p=0.5)
        t, n = _verify(jnp.asarray(logits), meta, jnp.asarray(drafts), all_greedy=all_greedy)
        np.testing.assert_array_equal(np.asarray(t), ref_t)
        np.testing.assert_array_equal(np.asarray(n), ref_n)
    # greedy rows beside sampled ones (odd rows sampled) keep their tokens
    meta = _meta(r, temperature=np.where(np.arange(r) % 2, 1.0, 0.0))
    t, n = _verify(jnp.asarray(logits), meta, jnp.asarray(drafts), all_greedy=False)
    np.testing.assert_array_equal(np.asarray(t)[::2], ref_t[::2])
    np.testing.assert_array_equal(np.asarray(n)[::2], ref_n[::2])


@pytest.mark.parametrize("filters", [True, False], ids=["top_k_p_min_p", "min_p_only"])
def test_rows_without_drafts_emit_sample_token(filters):
    rng = np.random.default_rng(1)
    r, q, v = 12, 4, 48
    logits = jnp.asarray(rng.standard_normal((r, q, v)).astype(np.float32) * 2)
    drafts = np.full((r, q), -1, np.int32)
    drafts[r // 2 :, :2] = rng.integers(0, v, (r - r // 2, 2))  # the other half has drafts
    kw = dict(
        temperature=np.tile([0.0, 0.7, 1.0, 1.3], r // 4),
        top_k=np.tile([0, 5, 0, 20, 3, 0], r // 6) if filters else 0,
        top_p=np.tile([1.0, 0.8, 0.5], r // 3) if filters else 1.0,
        min_p=np.tile([0.0, 0.0, 0.1, 0.05], r // 4),
    )
    for step in range(6):
        seeds, dt = rng.integers(0, 2**32, r), (np.uint32, np.int32)[step % 2]  # i32: u32 bits
        meta = _meta(r, seeds=seeds, step_idx=step * 7, seed_dtype=dt, **kw)
        t, n = _verify(logits, meta, jnp.asarray(drafts), all_greedy=False)
        ref = np.asarray(_sample(logits[:, 0], meta, all_greedy=False))
        np.testing.assert_array_equal(np.asarray(n)[: r // 2], 1)
        np.testing.assert_array_equal(np.asarray(t)[: r // 2, 0], ref[: r // 2])
        np.testing.assert_array_equal(np.asarray(t)[: r // 2, 1:], 0)


# (temperature, top_k, top_p, min_p, rank of d_0 in p_0, rank of d_1 in p_1); rank 99: outside
# the filtered support (p(d) = 0, always rejected)
CASES = [
    (0.8, 0, 1.0, 0.0, 0, 0),  # likely drafts
    (0.7, 0, 1.0, 0.0, 3, 0),  # unlikely first draft
    (1.3, 6, 0.9, 0.0, 1, 2),  # top-k and top-p on
    (1.0, 0, 0.85, 0.05, 99, 0),  # top-p and min-p on, draft filtered out
]


def _chi2_check(stats, samples, p, what):
    """Chi-square goodness of fit of ``samples`` to ``p`` (bins with expectation < 5 pooled);
    tokens with p = 0 must never appear."""
    counts = np.bincount(samples, minlength=len(p)).astype(np.float64)
    assert counts[p == 0].sum() == 0, f"{what}: a filtered-out token was emitted"
    expected = counts.sum() * p
    big = expected >= 5
    obs = np.r_[counts[big], counts[~big & (p > 0)].sum()]
    exp = np.r_[expected[big], expected[~big & (p > 0)].sum()]
    keep = exp > 0
    pvalue = stats.chisquare(obs[keep], exp[keep]).pvalue
    assert pvalue > ALPHA, f"{what}: chi-square p-value {pvalue:.2e} < {ALPHA}"


def test_emitted_distribution_equals_target():
    """Each case's first emitted token ~ p_0; given d_0 accepted, the second ~ p_1; given d_0
    and d_1 accepted, the bonus ~ p_2; acceptance of d_0 at rate p_0(d_0) (binomial test)."""
    stats = pytest.importorskip("scipy.stats")
    rng = np.random.default_rng(2)
    n, q, v = 5000, 3, 12
    base = rng.standard_normal((len(CASES), q, v)) * 1.5
    logits = np.repeat(base, n, axis=0).astype(np.float32)
    col = lambda j: np.repeat([c[j] for c in CASES], n)
    p = [
        [np_filtered_probs(base[c, j], *CASES[c][:4]) for j in range(q)] for c in range(len(CASES))
    ]
    drafts = np.full((len(CASES) * n, q), -1, np.int32)
    for c, case in enumerate(CASES):
        for j in range(2):
            order = np.argsort(-p[c][j], kind="stable")
            drafts[c * n : (c + 1) * n, j] = order[-1] if case[4 + j] == 99 else order[case[4 + j]]
    meta = _meta(len(CASES) * n, temperature=col(0), top_k=col(1), top_p=col(2), min_p=col(3))
    meta = meta.replace(seeds=jnp.arange(len(CASES) * n, dtype=jnp.uint32) * 7919)
    t, e = _verify(jnp.asarray(logits), meta, jnp.asarray(drafts), all_greedy=False)
    t, e = np.asarray(t), np.asarray(e)
    for c in range(len(CASES)):
        tc, ec, d0 = t[c * n : (c + 1) * n], e[c * n : (c + 1) * n], drafts[c * n, 0]
        assert np.all((ec >= 1) & (ec <= 3))
        assert stats.binomtest(int((ec >= 2).sum()), n, p[c][0][d0]).pvalue > ALPHA
        _chi2_check(stats, tc[:, 0], p[c][0], f"case {c}: first token")
        for j in (1, 2):
            given = ec > j
            assert np.all(tc[~given, j] == 0)
            if given.sum() >= 500:
                _chi2_check(stats, tc[given, j], p[c][j], f"case {c}: token {j} after accepts")
    assert (e[:n] == 3).sum() >= 500  # case 0 did test the bonus


def test_deterministic_and_seeded():
    rng = np.random.default_rng(3)
    r, q, v = 32, 4, 16
    logits = jnp.asarray(rng.standard_normal((r, q, v)).astype(np.float32) * 0.3)
    drafts = jnp.asarray(np.c_[rng.integers(0, v, (r, q - 1)), np.full(r, -1)].astype(np.int32))
    meta = _meta(r, step_idx=5)
    a = _verify(logits, meta, drafts, all_greedy=False)
    b = _verify(logits, meta, drafts, all_greedy=False)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    c = _verify(logits, meta.replace(seeds=meta.seeds + 1), drafts, all_greedy=False)
    assert np.any(np.asarray(a[0]) != np.asarray(c[0])) and np.any(a[1] != c[1])
    d = _verify(logits, meta.replace(step_idx=meta.step_idx + 1), drafts, all_greedy=False)
    assert np.any(np.asarray(a[0]) != np.asarray(d[0]))


def test_shape_errors_name_the_argument():
    r, q, v = 3, 4, 8
    logits, drafts, meta = jnp.zeros((r, q, v)), jnp.full((r, q), -1, jnp.int32), _meta(r)
    bad = [
        (jnp.zeros((r, v)), meta, drafts, "logits"),
        (logits, meta, jnp.full((r, q + 1), -1, jnp.int32), "draft_tokens"),
        (logits, meta, jnp.full((r, q), -1.0), "draft_tokens"),
        (logits, _meta(r + 1), drafts, "SamplingMetadata.temperature"),
        (logits, make_meta(r), drafts, "SamplingMetadata.repetition_penalty"),
    ]
    for lg, m, dr, name in bad:
        with pytest.raises(ValueError, match=name):
            verify(lg, m, dr, all_greedy=False)
