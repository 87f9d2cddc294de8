"""Tests for jaxinfer.runner.sampling against independent numpy (float64) and HF transformers
references."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.runner.sampling import (
    SamplingMetadata,
    _check_shapes,
    _filter_sorted,
    _penalised,
    _scale,
    _sort_desc,
    apply_repetition_penalty,
    sample,
)


def filtered_logits(logits: jax.Array, meta: SamplingMetadata) -> jax.Array:
    """f32[B, V] logits `sample` draws from (vocab order; filtered: -inf). ValueError: shapes."""
    _check_shapes(logits, meta)
    vals, ids = _sort_desc(_scale(_penalised(logits, meta), meta.temperature))
    vals = _filter_sorted(vals, meta.top_k, meta.top_p, meta.min_p)
    rows = jnp.arange(vals.shape[0], dtype=jnp.int32)[:, None]
    return jnp.full_like(vals, -jnp.inf).at[rows, ids].set(vals)


_sample = jax.jit(sample, static_argnames="all_greedy")
_filtered = jax.jit(filtered_logits)
_penalty = jax.jit(apply_repetition_penalty)


def make_meta(
    b,
    *,
    temperature=1.0,
    top_k=0,
    top_p=1.0,
    min_p=0.0,
    repetition_penalty=1.0,
    seeds=None,
    step_idx=0,
    penalty_tokens=None,
    seed_dtype=np.uint32,
):
    """Metadata with scalars broadcast to B rows."""

    def row(x, dt):
        return jnp.asarray(np.broadcast_to(np.asarray(x, dt), (b,)).copy())

    if seeds is None:
        seeds = np.arange(b) + 1000
    if penalty_tokens is None:
        penalty_tokens = np.full((b, 0), -1, np.int32)
    return SamplingMetadata(
        temperature=row(temperature, np.float32),
        top_k=row(top_k, np.int32),
        top_p=row(top_p, np.float32),
        min_p=row(min_p, np.float32),
        repetition_penalty=row(repetition_penalty, np.float32),
        seeds=row(np.asarray(seeds).astype(seed_dtype), seed_dtype),
        step_idx=row(step_idx, np.int32),
        penalty_tokens=jnp.asarray(np.asarray(penalty_tokens, np.int32)),
    )


# ----------------------------------------------------------------------------- numpy references


def np_repetition_penalty(logits, token_lists, penalties):
    """HF RepetitionPenaltyLogitsProcessor, per row, in float32 numpy."""
    out = np.array(logits, np.float32, copy=True)
    for b, (toks, p) in enumerate(zip(token_lists, penalties)):
        for t in set(int(t) for t in toks):
            s = out[b, t]
            out[b, t] = s / np.float32(p) if s > 0 else s * np.float32(p)
    return out


def np_filtered_probs(logits, t, k, p, min_p, margin=1e-4):
    """float64 reference: softmax(logits/T) -> top-k -> top-p -> min-p, renormalised each step.

    Also asserts that no filter boundary lies within `margin` (so float32 rounding cannot flip it).
    """
    z = np.asarray(logits, np.float64) / t
    order = np.argsort(-z, kind="stable")
    q = np.exp(z - z.max())
    q /= q.sum()
    kept = list(order[:k]) if k > 0 else list(order)
    if k > 0 and k < len(order):
        assert z[order[k - 1]] - z[order[k]] > margin, "top-k boundary tie"
    qk = np.zeros_like(q)
    qk[kept] = q[kept]
    qk /= qk.sum()
    if p < 1:
        nucleus, mass = [], 0.0
        for tok in kept:
            nucleus.append(tok)
            mass += qk[tok]
            assert abs(mass - p) > margin, "top-p boundary too close"
            if mass >= p:
                break
        kept = nucleus
    qp = np.zeros_like(q)
    qp[kept] = qk[kept]
    qp /= qp.sum()
    if min_p > 0:
        thr = min_p * qp.max()
        assert np.all(np.abs(qp[kept] - thr) > margin * thr), "min-p boundary too close"
        kept = [tok for tok in kept if qp[tok] >= thr]
    out = np.zeros_like(q)
    out[kept] = qp[kept]
    return out / out.sum()


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
