"""The verifier of speculative decoding: the rejection sampler of Leviathan et al. 2023, "Fast
Inference from Transformers via Speculative Decoding" (Algorithm 1, its Appendix A.1 residual), for
deterministic (one-hot) proposals: vLLM V1's ``RejectionSampler`` with ``draft_probs=None``
(n-gram, greedy draft models, EAGLE). Shape letters: R rows, Q = k + 1 verified positions per row,
V vocab.

Position j of row r scores as `jaxinfer.runner.sampling.sample` scores row r at ``step_idx + j``
(same filters, same Gumbel noise). Greedy rows accept a draft while it is the argmax; sampled rows
accept draft d with probability p(d), and at the first rejection draw from p with d removed and
renormalised (``max(0, p - onehot(d))`` normalised), so every emitted token is distributed as
plain sampling's and greedy rows emit plain greedy decoding's tokens. A position's acceptance
uniform comes from ``fold_in(sampling's key, _ACCEPT_STREAM)``, a stream apart from its noise."""

import jax
import jax.numpy as jnp

from jaxinfer.runner.sampling import (
    _PRNG_IMPL,
    SamplingMetadata,
    _filter_sorted,
    _gumbel_noise,
    _is_greedy,
    _min_p_keep,
    _penalised,
    _scale,
    _sort_desc,
)
from jaxinfer.step_input import names

_ACCEPT_STREAM = 0x61636370  # folded into a position's key for its acceptance uniform


def _check_inputs(logits, meta: SamplingMetadata, draft_tokens) -> None:
    """ValueError (trace time) naming the argument or field whose rank, shape or dtype is wrong,
    or an optional `SamplingMetadata` field (penalties, bias, bitmask) that is not None."""
    if logits.ndim != 3:
        raise ValueError(f"logits must be f32[R, Q, V]; got shape {tuple(logits.shape)}")
    r, q, _ = shape = tuple(logits.shape)
    if tuple(draft_tokens.shape) != (r, q) or not jnp.issubdtype(draft_tokens.dtype, jnp.integer):
        raise ValueError(
            f"draft_tokens must be i32[R, Q] = i32[{r}, {q}] to match logits {shape}; "
            f"got {draft_tokens.dtype}{list(draft_tokens.shape)}"
        )
    for n in names("sampling"):
        a = getattr(meta, n)
        if n not in names("sampling", "sample"):
            if a is not None:
                raise ValueError(f"SamplingMetadata.{n} must be None: verify applies no penalties")
        elif a.ndim != 1 or a.shape[0] != r:
            raise ValueError(
                f"SamplingMetadata.{n} must have shape ({r},) to match logits {shape}; "
                f"got {tuple(a.shape)}"
            )


def _accept_uniforms(seeds: jax.Array, steps: jax.Array) -> jax.Array:
    """f32[N] in [0, 1): entry i from ``fold_in(fold_in(key(seeds[i]), steps[i]),
    _ACCEPT_STREAM)`` (``seeds`` u32 or i32 bits, as `_gumbel_noise`), independent of
    `_gumbel_noise`'s draw at the same (seed, step)."""

    def one(seed, step):
        key = jax.random.fold_in(jax.random.key(seed, impl=_PRNG_IMPL), step)
        return jax.random.uniform(jax.random.fold_in(key, _ACCEPT_STREAM), (), jnp.float32)

    return jax.vmap(one)(jax.lax.bitcast_convert_type(seeds, jnp.uint32), steps)


def _draw(vals: jax.Array, g: jax.Array, is_d: jax.Array, ids: jax.Array):
    """From filtered logits ``vals`` f32[N, V] (-inf: dropped; any order), noise ``g`` in the same
    order, ``is_d`` bool[N, V] (the draft's entry, at most one per row) and ``ids`` i32[N, V]
    (vocab ids in that order): (log p(draft) f32[N], -inf without a draft; the Gumbel-max id i32[N]
    with the draft excluded, i.e. a sample of p with the draft removed, renormalised)."""
    log_p = jnp.max(jnp.where(is_d, vals, -jnp.inf), axis=-1) - jax.nn.logsumexp(vals, axis=-1)
    pick = jnp.argmax(jnp.where(is_d, -jnp.inf, vals + g), axis=-1)
    return log_p, jnp.take_along_axis(ids, pick[:, None], axis=-1)[:, 0].astype(jnp.int32)


def _sampled_draws(x: jax.Array, rows: dict, g: jax.Array, d: jax.Array):
    """`_draw` on N = R * Q positions: ``x`` f32[N, V] penalised logits, ``rows`` the
    temperature, top_k, top_p, min_p per position [N], ``g`` f32[N, V] noise, ``d`` i32[N] the
    draft to score and exclude (-1: none). Filters as `sampling.sample`: one sort, only when a
    sampled position has top-k or top-p on, so a position without a draft picks its token."""
    v = x.shape[1]
    scaled = _scale(x, rows["temperature"])

    def with_sort():
        vals, ids = _sort_desc(scaled)
        vals = _filter_sorted(vals, rows["top_k"], rows["top_p"], rows["min_p"])
        return _draw(vals, jnp.take_along_axis(g, ids, axis=-1), ids == d[:, None], ids)

    def without_sort():  # exact when no sampled position has an active top-k or top-p
        kept = jnp.where(_min_p_keep(scaled, rows["min_p"]), scaled, -jnp.inf)
        ids = jax.lax.broadcasted_iota(jnp.int32, x.shape, 1)
        return _draw(kept, g, ids == d[:, None], ids)

    k_on = (rows["top_k"] > 0) & (rows["top_k"] < v)
    on = ~_is_greedy(rows["temperature"]) & (k_on | ~(rows["top_p"] >= 1.0))
    return jax.lax.cond(jnp.any(on), with_sort, without_sort)


def _emit(d: jax.Array, accept: jax.Array, drawn: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(tokens i32[R, Q], num_emitted i32[R]): the drafts ``d`` before the first False of
    ``accept`` bool[R, Q] (its column Q - 1 False), then ``drawn`` i32[R, Q] at it, then 0."""
    n = jnp.sum(jnp.cumprod(accept.astype(jnp.int32), axis=1), axis=1)[:, None]
    col = jnp.arange(d.shape[1], dtype=jnp.int32)[None, :]
    tokens = jnp.where(col < n, d, jnp.where(col == n, drawn, 0))
    return tokens.astype(jnp.int32), (n[:, 0] + 1).astype(jnp.int32)


def verify(
    logits: jax.Array, meta: SamplingMetadata, draft_tokens: jax.Array, *, all_greedy: bool
) -> tuple[jax.Array, jax.Array]:
    """The speculative-decoding verifier (Leviathan et al. 2023, one-hot drafts), jit-able.

    ``logits`` f32[R, Q, V] (any float): the target's logits at row r's Q = k + 1 verified
    positions, position j scoring the token after the row's j-th input token; ``meta`` a
    `SamplingMetadata` of R rows (temperature, top_k, top_p, min_p, seeds, step_idx; the optional
    fields must be None); ``draft_tokens`` i32[R, Q]: d_0..d_{n_r - 1} then -1 (n_r <= Q - 1; ids
    outside [0, V) and column Q - 1 are never accepted). ``all_greedy`` (static): argmax only.

    Returns (tokens i32[R, Q], num_emitted i32[R] in [1, n_r + 1]): row r emits
    ``tokens[r, :num_emitted[r]]``, its accepted drafts then one token drawn at the first rejected
    position from the residual (p_j with d_j removed), or at n_r, all accepted, the bonus from
    p_{n_r}; 0 after. p_j is `sampling.sample`'s distribution at ``step_idx + j`` (greedy rows:
    the argmax), with its Gumbel noise there: a row without drafts emits `sample`'s token.
    Deterministic in (seeds, step_idx, drafts). ValueError (trace time): ranks or shapes."""
    _check_inputs(logits, meta, draft_tokens)
    r, q, v = logits.shape
    x = _penalised(logits.reshape(r * q, v), meta)  # f32, NaN -> -inf (no penalty fields)
    d = draft_tokens.astype(jnp.int32)
    valid = (d >= 0) & (d < v) & (jnp.arange(q)[None, :] < q - 1)
    target = jnp.argmax(x, axis=-1).astype(jnp.int32).reshape(r, q)
    if all_greedy:
        return _emit(d, valid & (d == target), target)
    steps = (meta.step_idx.astype(jnp.int32)[:, None] + jnp.arange(q, dtype=jnp.int32)).reshape(-1)
    seeds = jnp.repeat(meta.seeds, q)
    rows = {n: jnp.repeat(getattr(meta, n), q) for n in ("temperature", "top_k", "top_p", "min_p")}
    g = _gumbel_noise(seeds, steps, v)  # position j: plain sampling's noise at step_idx + j
    log_p, drawn = _sampled_draws(x, rows, g, jnp.where(valid, d, -1).reshape(-1))
    log_u = jnp.log(_accept_uniforms(seeds, steps)).reshape(r, q)
    greedy = _is_greedy(meta.temperature)[:, None]
    accept = valid & jnp.where(greedy, d == target, log_u < log_p.reshape(r, q))
    return _emit(d, accept, jnp.where(greedy, target, drawn.reshape(r, q)))
