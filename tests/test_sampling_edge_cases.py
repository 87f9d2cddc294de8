"""Tests for jaxinfer.runner.sampling's edge cases: a row's token independent of the rest of
the batch (seeds, CASES C7), extreme logits never giving NaN or a masked token, shape errors
naming the field."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from sampling_refs import _filtered, _sample, make_meta

from jaxinfer.runner.sampling import (
    sample,
)

# ----------------------------------------------------------------------------- seeds (C7)


def test_row_token_independent_of_batch_composition_c7():
    rng = np.random.default_rng(8)
    v = 64
    target = (rng.standard_normal(v) * 1.5).astype(np.float32)
    tgt = dict(temperature=0.8, top_k=40, top_p=0.95, min_p=0.01, repetition_penalty=1.1, seeds=42)
    tgt_hist = np.array([3, 9, 3, 17, -1, -1], np.int32)
    b = 5
    tokens_alone = []
    for step in range(8):
        m1 = make_meta(
            1, step_idx=step, penalty_tokens=tgt_hist[None], **{k: [val] for k, val in tgt.items()}
        )
        alone = int(_sample(jnp.asarray(target[None]), m1, all_greedy=False)[0])
        m1i = make_meta(
            1,
            step_idx=step,
            penalty_tokens=tgt_hist[None],
            seed_dtype=np.int32,
            **{k: [val] for k, val in tgt.items()},
        )
        assert int(_sample(jnp.asarray(target[None]), m1i, all_greedy=False)[0]) == alone
        tokens_alone.append(alone)
        for pos in range(b):
            logits = (rng.standard_normal((b, v)) * 1.5).astype(np.float32)
            logits[pos] = target
            cols = dict(
                temperature=rng.choice([0.0, 0.5, 1.0, 1.3], b),
                top_k=rng.choice([0, 5, 20], b),
                top_p=rng.choice([1.0, 0.5], b),
                min_p=rng.choice([0.0, 0.1], b),
                repetition_penalty=rng.choice([1.0, 1.3], b),
                seeds=rng.integers(0, 2**31, b),
            )
            for k, val in tgt.items():
                cols[k][pos] = val
            hist = rng.integers(-1, v, (b, 6)).astype(np.int32)
            hist[pos] = tgt_hist
            m = make_meta(b, step_idx=rng.integers(0, 50, b), penalty_tokens=hist, **cols)
            m = m.replace(step_idx=m.step_idx.at[pos].set(step))
            got = np.asarray(_sample(jnp.asarray(logits), m, all_greedy=False))
            assert got[pos] == alone, (step, pos)
    assert len(set(tokens_alone)) > 1  # the draw really is random across steps


# ----------------------------------------------------------------------------- extremes, errors


def test_extreme_inputs_never_nan():
    v = 32
    rng = np.random.default_rng(9)
    big = np.finfo(np.float32).max
    rows = [
        rng.standard_normal(v) * 1e30,
        np.where(rng.random(v) < 0.5, -np.inf, rng.standard_normal(v)),
        np.full(v, -np.inf),
        np.r_[np.inf, rng.standard_normal(v - 1)],
        np.r_[rng.standard_normal(v - 2), np.nan, 1.0],
        np.r_[big, -big, rng.standard_normal(v - 2)],
        np.full(v, 3.0),
        rng.standard_normal(v) * 1e-30,
    ]
    base = np.stack(rows).astype(np.float32)
    base[3] = np.roll(base[3], 5)  # +inf at index 5
    nr = base.shape[0]
    temps = [0.0, 1e-6, 1e-4, 0.5, 1.0, 100.0]
    combos = [
        (t, k, p, mp, rp)
        for t in temps
        for (k, p, mp, rp) in [
            (0, 1.0, 0.0, 1.0),
            (3, 1e-9, 0.0, 1.0),
            (0, 0.5, 0.5, 1.3),
            (1, 0.0, 1.0, 0.5),
        ]
    ]
    logits = np.tile(base, (len(combos), 1))
    cidx = np.repeat(np.arange(len(combos)), nr)
    cols = np.array(combos)[cidx]
    hist = np.tile(np.arange(6, dtype=np.int32)[None], (logits.shape[0], 1))
    meta = make_meta(
        logits.shape[0],
        temperature=cols[:, 0],
        top_k=cols[:, 1],
        top_p=cols[:, 2],
        min_p=cols[:, 3],
        repetition_penalty=cols[:, 4],
        seeds=np.arange(logits.shape[0]),
        penalty_tokens=hist,
    )
    for dt in (jnp.float32, jnp.bfloat16):
        x = jnp.asarray(logits).astype(dt)
        f = np.asarray(_filtered(x, meta))
        assert not np.isnan(f).any()
        for greedy in (False, True):
            m = meta if not greedy else meta.replace(temperature=jnp.zeros_like(meta.temperature))
            out = np.asarray(_sample(x, m, all_greedy=greedy))
            assert out.min() >= 0 and out.max() < v
            xv = np.asarray(x.astype(jnp.float32))
            chosen = xv[np.arange(len(out)), out]
            has_finite = np.isfinite(xv).any(-1)
            assert not np.any(np.isneginf(chosen) & has_finite)
            assert not np.isnan(chosen).any()
            assert np.all(out[np.arange(len(out)) % nr == 3] == 5)  # the +inf token wins


def test_shape_errors_name_the_field():
    meta = make_meta(3)
    with pytest.raises(ValueError, match="top_p"):
        sample(jnp.zeros((3, 8)), meta.replace(top_p=jnp.ones((2,))), all_greedy=False)
    with pytest.raises(ValueError, match="penalty_tokens"):
        sample(
            jnp.zeros((3, 8)),
            meta.replace(penalty_tokens=jnp.zeros((3,), jnp.int32)),
            all_greedy=True,
        )
    with pytest.raises(ValueError, match="logits"):
        sample(jnp.zeros((8,)), meta, all_greedy=True)
