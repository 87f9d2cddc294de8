"""Tests for jaxinfer.runner.sampling against independent numpy (float64) and HF transformers
references: the repetition penalty, greedy equivalences, the sampled distribution (references:
tests/sampling_refs.py; seeds, extreme inputs, errors: tests/test_sampling_edge_cases.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from sampling_refs import (  # filtered_logits: tests/engine/test_penalties.py imports it here
    _filtered,
    _penalty,
    _sample,
    filtered_logits,  # noqa: F401
    make_meta,
    np_filtered_probs,
    np_repetition_penalty,
)

# ----------------------------------------------------------------------------- repetition penalty


def test_repetition_penalty_matches_numpy_and_hf():
    torch = pytest.importorskip("torch")
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    rng = np.random.default_rng(0)
    b, v, r = 4, 64, 12
    logits = (rng.standard_normal((b, v)) * 3).astype(np.float32)
    penalties = np.array([1.0, 1.3, 0.7, 2.0], np.float32)
    lists = [rng.integers(0, v, size=n) for n in (12, 5, 9, 1)]
    lists[1] = np.concatenate([lists[1], lists[1][:2]])  # duplicates
    padded = np.full((b, r), -1, np.int32)
    for i, lst in enumerate(lists):
        padded[i, : len(lst)] = lst

    got = np.asarray(_penalty(jnp.asarray(logits), jnp.asarray(padded), jnp.asarray(penalties)))
    ref = np_repetition_penalty(logits, lists, penalties)
    # XLA may divide as a multiply by the reciprocal: allow 2 ulp
    np.testing.assert_allclose(got, ref, rtol=2.5e-7, atol=0)
    assert np.any(got != logits)
    for i, lst in enumerate(lists):
        proc = RepetitionPenaltyLogitsProcessor(penalty=float(penalties[i]))
        hf = proc(
            torch.tensor(lst[None], dtype=torch.long), torch.tensor(logits[i : i + 1])
        ).numpy()
        np.testing.assert_allclose(got[i], hf[0], rtol=2.5e-7, atol=0)
    # penalty 1.0 leaves its row bit-identical; R = 0 is a no-op
    np.testing.assert_array_equal(got[0], logits[0])
    got0 = _penalty(jnp.asarray(logits), jnp.zeros((b, 0), jnp.int32), jnp.asarray(penalties))
    np.testing.assert_array_equal(np.asarray(got0), logits)


def test_penalty_row_unaffected_by_neighbour_c10():
    rng = np.random.default_rng(1)
    v = 64
    logits = (rng.standard_normal((2, v)) * 2).astype(np.float32)
    order = np.argsort(-logits[0])
    logits[0, order[0]] = logits[0, order[1]] + 0.1  # small top-2 gap: penalty 1.3 flips it
    assert logits[0, order[1]] > 1.0
    logits[1] = logits[0]  # same logits: B's penalty would change A's token if it leaked
    top = np.r_[order[0], order[5:8]]
    toks = np.full((2, 6), -1, np.int32)
    toks[0, :4] = top  # A has history but penalty 1.0
    toks[1, :4] = top
    meta2 = make_meta(2, repetition_penalty=[1.0, 1.3], penalty_tokens=toks, temperature=0.0)
    meta_a = make_meta(1, repetition_penalty=1.0, penalty_tokens=toks[:1], temperature=0.0)
    for greedy in (True, False):
        both = np.asarray(_sample(jnp.asarray(logits), meta2, all_greedy=greedy))
        alone = np.asarray(_sample(jnp.asarray(logits[:1]), meta_a, all_greedy=greedy))
        assert both[0] == alone[0] == np.argmax(logits[0])
        ref_b = np.argmax(np_repetition_penalty(logits[1:], [top], [1.3])[0])
        assert both[1] == ref_b
    assert ref_b != both[0]  # the penalty did act on row B
    # sampled row A next to penalised row B
    meta2s = meta2.replace(
        temperature=jnp.asarray([0.9, 0.9], jnp.float32), seeds=jnp.asarray([7, 8], jnp.uint32)
    )
    for step in range(4):
        m2 = meta2s.replace(step_idx=jnp.full((2,), step, jnp.int32))
        both = np.asarray(_sample(jnp.asarray(logits), m2, all_greedy=False))
        ma = make_meta(1, temperature=0.9, seeds=[7], step_idx=step, penalty_tokens=toks[:1])
        alone = np.asarray(_sample(jnp.asarray(logits[:1]), ma, all_greedy=False))
        assert both[0] == alone[0]


# ----------------------------------------------------------------------------- greedy equivalences

V_BIG = 2048


def _big_logits(b, seed, dtype=np.float32):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((b, V_BIG)) * 3).astype(dtype)


def test_greedy_paths_equal_argmax():
    b = 16
    logits = _big_logits(b, 2)
    ref = np.argmax(logits, axis=-1)
    meta = make_meta(b, temperature=0.0, seeds=np.arange(b) * 31, step_idx=3)
    np.testing.assert_array_equal(
        np.asarray(_sample(jnp.asarray(logits), meta, all_greedy=True)), ref
    )
    np.testing.assert_array_equal(
        np.asarray(_sample(jnp.asarray(logits), meta, all_greedy=False)), ref
    )
    # top_k = 1 with a real temperature, many seeds
    for step in range(4):
        m = make_meta(b, temperature=1.0, top_k=1, seeds=np.arange(b) * 7 + step, step_idx=step)
        np.testing.assert_array_equal(
            np.asarray(_sample(jnp.asarray(logits), m, all_greedy=False)), ref
        )


@pytest.mark.parametrize("top_p", [0.0, 1e-9])
def test_tiny_top_p_keeps_exactly_top_token_c5(top_p):
    b = 16
    logits = _big_logits(b, 3)
    ref = np.argmax(logits, axis=-1)
    meta = make_meta(b, temperature=0.6, top_k=1000, top_p=top_p)
    f = np.asarray(_filtered(jnp.asarray(logits), meta))
    assert not np.isnan(f).any()
    np.testing.assert_array_equal(np.isfinite(f).sum(-1), 1)
    np.testing.assert_array_equal(np.argmax(f, -1), ref)
    for step in range(4):
        m = meta.replace(step_idx=jnp.full((b,), step, jnp.int32))
        np.testing.assert_array_equal(
            np.asarray(_sample(jnp.asarray(logits), m, all_greedy=False)), ref
        )


@pytest.mark.parametrize("top_k", [0, -1])
def test_top_k_off_means_no_filter_c5(top_k):
    b = 16
    logits = _big_logits(b, 4)
    meta = make_meta(b, temperature=0.6, top_k=top_k)
    f = np.asarray(_filtered(jnp.asarray(logits), meta))
    assert np.isfinite(f).all()
    ref = (logits - logits.max(-1, keepdims=True)) / np.float32(0.6)
    np.testing.assert_allclose(f, ref, rtol=1e-6, atol=1e-5)
    f_full = np.asarray(
        _filtered(jnp.asarray(logits), meta.replace(top_k=jnp.full((b,), V_BIG, jnp.int32)))
    )
    np.testing.assert_array_equal(f, f_full)


@pytest.mark.parametrize("temperature", [1e-6, 1e-4])
def test_tiny_temperature_bf16_equals_greedy_c6(temperature):
    b = 16
    logits = jnp.asarray(_big_logits(b, 5), jnp.bfloat16)
    l32 = np.asarray(logits.astype(jnp.float32))
    srt = np.sort(l32, -1)
    gap_ok = (srt[:, -1] - srt[:, -2]) > 0.01
    assert gap_ok.sum() >= b // 2
    ref = np.argmax(l32, -1)
    # row 0 is an ordinary sampled request next to the tiny-temperature rows
    temps = np.full(b, temperature, np.float32)
    temps[0] = 0.8
    meta = make_meta(b, temperature=temps, top_k=50, top_p=0.95, seeds=np.arange(b) + 5, step_idx=2)
    f = np.asarray(_filtered(logits, meta))
    assert not np.isnan(f).any()
    assert np.isfinite(f.max(-1)).all()
    out = np.asarray(_sample(logits, meta, all_greedy=False))
    np.testing.assert_array_equal(out[1:][gap_ok[1:]], ref[1:][gap_ok[1:]])
    alone = np.asarray(
        _sample(
            logits[:1],
            make_meta(1, temperature=0.8, top_k=50, top_p=0.95, seeds=[5], step_idx=2),
            all_greedy=False,
        )
    )
    assert out[0] == alone[0]


# ----------------------------------------------------------------------------- distribution

V_SMALL = 8
N_DRAWS = 20000
# (temperature, top_k, top_p, min_p, repetition_penalty)
CONFIGS = [
    (1.0, 0, 1.0, 0.0, 1.0),
    (0.7, 0, 1.0, 0.0, 1.0),
    (1.5, 3, 1.0, 0.0, 1.0),
    (1.0, 0, 0.7, 0.0, 1.0),
    (1.0, 0, 1.0, 0.15, 1.0),
    (0.8, 5, 0.8, 0.05, 1.0),
    (1.2, 6, 0.9, 0.0, 1.3),
    (1.0, V_SMALL, 1.0, 0.0, 1.0),
]
NO_SORT = [0, 1, 4, 7]  # configs with neither top-k nor top-p active


def test_empirical_distribution_matches_reference():
    rng = np.random.default_rng(6)
    n_cfg = len(CONFIGS)
    base = (rng.standard_normal((n_cfg, V_SMALL)) * 1.5).astype(np.float32)
    hist = np.stack([rng.permutation(V_SMALL)[:3] for _ in range(n_cfg)]).astype(np.int32)
    refs = []
    for c, (t, k, p, mp, rp) in enumerate(CONFIGS):
        pen = np_repetition_penalty(base[c : c + 1], [hist[c]], [rp])[0]
        refs.append(np_filtered_probs(pen, t, k, p, mp))
    cols = np.array(CONFIGS, np.float64)
    rows = np.repeat(np.arange(n_cfg), N_DRAWS)
    bsz = rows.size
    # first half of each config's draws: distinct seeds, one step; second half: one seed, many steps
    j = np.tile(np.arange(N_DRAWS), n_cfg)
    seeds = np.where(j < N_DRAWS // 2, j * 7919 + rows, 12345 + rows).astype(np.uint32)
    steps = np.where(j < N_DRAWS // 2, 5, j).astype(np.int32)
    meta = make_meta(
        bsz,
        temperature=cols[rows, 0],
        top_k=cols[rows, 1],
        top_p=cols[rows, 2],
        min_p=cols[rows, 3],
        repetition_penalty=cols[rows, 4],
        seeds=seeds,
        step_idx=steps,
        penalty_tokens=hist[rows],
    )
    out = np.asarray(_sample(jnp.asarray(base[rows]), meta, all_greedy=False))
    assert out.min() >= 0 and out.max() < V_SMALL
    # the configs without top-k/top-p, alone in a batch, take the no-sort branch: same tokens
    sub = np.isin(rows, NO_SORT)
    meta_sub = jax.tree_util.tree_map(lambda a: a[sub], meta)
    out_sub = np.asarray(_sample(jnp.asarray(base[rows[sub]]), meta_sub, all_greedy=False))
    np.testing.assert_array_equal(out_sub, out[sub])
    for c in range(n_cfg):
        counts = np.bincount(out[rows == c], minlength=V_SMALL)
        ref = refs[c]
        assert np.all(counts[ref == 0] == 0), (c, counts, ref)
        freq = counts / N_DRAWS
        bound = 5 * np.sqrt(ref * (1 - ref) / N_DRAWS) + 1.0 / N_DRAWS
        assert np.all(np.abs(freq - ref) <= bound), (c, freq, ref, bound)
        # both halves (seed-varied and step-varied) are themselves distributed correctly
        for half in (out[rows == c][: N_DRAWS // 2], out[rows == c][N_DRAWS // 2 :]):
            f = np.bincount(half, minlength=V_SMALL) / half.size
            assert np.all(
                np.abs(f - ref) <= 5 * np.sqrt(ref * (1 - ref) / half.size) + 1.0 / half.size
            ), (c, f, ref)
    # the filters actually removed something in the filtered configs
    assert all((refs[c] == 0).sum() >= 2 for c in (2, 3, 4, 5))
