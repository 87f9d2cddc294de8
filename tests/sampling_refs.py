"""What the sampling tests share: `make_meta` (a batch's `SamplingMetadata` from scalars or
columns), jitted `sample` / `filtered_logits` / `apply_repetition_penalty`, and independent numpy
references of the repetition penalty and the filters."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

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
