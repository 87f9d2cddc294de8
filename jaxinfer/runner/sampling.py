"""On-device token sampling, row-wise (CASES.md C7), in vLLM's order: 0. logit_bias, min_tokens
mask; 1. repetition, frequency, presence penalties; 2. greedy rows (T < `GREEDY_EPS`): argmax; 3.
``(logits - max) / T`` in f32 (C6); 4. top-k; 5. top-p, top token kept (C5); 6. min-p; 7.
Gumbel-max, row key ``fold_in(key(seed), step_idx)``. 4-5 on one stable descending sort (ties: lower
id first), if a sampled row uses them. NaN logits count as -inf, +inf as the largest f32."""

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from jaxinfer.sampling_params import GREEDY_EPS  # rows below it (or NaN) are greedy
from jaxinfer.step_input import FIELDS, names

_PRNG_IMPL = "threefry2x32"  # pinned so a seed maps to the same stream on every JAX version


def pytree_dataclass(module: str, name: str, required, optional, doc: str) -> type:
    """A frozen dataclass ``module.name`` with fields ``required`` then ``optional`` (default
    None), registered as a pytree of them all, with ``replace(**changes)``."""
    namespace = dict(
        __doc__=doc, __module__=module, replace=lambda self, **kw: dataclasses.replace(self, **kw)
    )
    cls = dataclasses.make_dataclass(
        name, [*required, *((n, Any, None) for n in optional)], frozen=True, namespace=namespace
    )
    return jax.tree_util.register_dataclass(cls, [*required, *optional], [])


SamplingMetadata = pytree_dataclass(
    __name__,
    "SamplingMetadata",
    names("sampling", "greedy"),
    [n for n in names("sampling", spec=1) if n not in names("sampling", "greedy")],
    doc="""
    Per-row parameters ("sampling" in `jaxinfer.step_input.FIELDS`): temperature f32[B];
    top_k i32[B] (<= 0: off); top_p f32[B] (>= 1: off); min_p f32[B] (0: off); seeds u32[B] or
    i32[B] (u32 bits); step_idx i32[B]; optional (None: off; present at level "full"):
    repetition_penalty f32[B] (1: off); penalty_tokens i32[B, R] (ids outside [0, V) ignored);
    prompt_lens i32[B] (the first prompt_lens entries of penalty_tokens are the prompt, the rest
    the output), presence_penalty, frequency_penalty f32[B]; bias_ids i32[B, E] (outside [0,
    V): ignored), bias_values f32[B, E] added to the logits (-inf: masked); bitmask i32[B, W]
    (`apply_token_bitmask`); processor_rows i32[B, J] (`apply_logits_processors`); draft_tokens
    i32[B, Q] (a verify step's drafts, `jaxinfer.runner.rejection`).""",
)


def _check_shapes(logits, meta: SamplingMetadata) -> None:
    """Raises ValueError naming the field whose shape is not its `FIELDS` one, B = logits' rows."""
    if logits.ndim != 2:
        raise ValueError(f"logits must be [B, V]; got shape {tuple(logits.shape)}")
    b = logits.shape[0]
    for f in FIELDS:
        a = getattr(meta, f.name) if f.group == "sampling" else None
        if a is not None and (a.ndim != len(f.shape) or a.shape[0] != b):
            raise ValueError(
                f"SamplingMetadata.{f.name} must have shape "
                f"({', '.join((str(b), *f.shape[1:]))}) to match logits "
                f"{tuple(logits.shape)}; got {tuple(a.shape)}"
            )


def _scatter(ids: jax.Array, v: int, vals: jax.Array, into: jax.Array) -> jax.Array:
    """``into`` [B, V] with ``vals`` [B, R] added at ``ids`` i32[B, R] (outside [0, V): dropped)."""
    ids = jnp.where((ids >= 0) & (ids < v), ids, v)
    rows = jnp.arange(ids.shape[0], dtype=jnp.int32)[:, None]
    return into.at[rows, ids].add(vals.astype(into.dtype), mode="drop")


def apply_repetition_penalty(
    logits: jax.Array, penalty_tokens: jax.Array, penalty: jax.Array
) -> jax.Array:
    """f32[B, V]: logits of tokens in ``penalty_tokens`` i32[B, R] divided (> 0) or multiplied
    by ``penalty`` f32[B], once per token. Source: HF ``RepetitionPenaltyLogitsProcessor``."""
    b, v = logits.shape
    if penalty_tokens.shape[1] == 0:
        return logits
    present = _scatter(penalty_tokens, v, jnp.ones(penalty_tokens.shape), jnp.zeros((b, v))) > 0
    p = penalty.astype(jnp.float32)[:, None]
    return jnp.where(present, jnp.where(logits > 0, logits / p, logits * p), logits)


def _history_penalties(x: jax.Array, meta: SamplingMetadata) -> jax.Array:
    """Repetition penalty, then (``prompt_lens``) ``- frequency x count - presence x [count >
    0]`` over the outputs in ``penalty_tokens``."""
    v, toks = x.shape[1], meta.penalty_tokens
    x = apply_repetition_penalty(x, toks, meta.repetition_penalty)
    if meta.prompt_lens is None or not toks.shape[1]:
        return x
    out = jnp.arange(toks.shape[1])[None, :] >= meta.prompt_lens[:, None]
    counts = _scatter(toks, v, out, jnp.zeros_like(x))
    return (
        x - meta.frequency_penalty[:, None] * counts - meta.presence_penalty[:, None] * (counts > 0)
    )


def apply_penalties(logits: jax.Array, meta: SamplingMetadata) -> jax.Array:
    """f32[B, V]: ``bias_values`` at ``bias_ids``, then `_history_penalties` when some row has
    one (None fields: off). Source: vLLM ``LogitBiasLogitsProcessor``,
    ``MinTokensLogitsProcessor``, ``ops/penalties.py``."""
    x, v = logits.astype(jnp.float32), logits.shape[1]
    if meta.bias_ids is not None:
        x = _scatter(meta.bias_ids, v, meta.bias_values, x)
    if meta.penalty_tokens is None:
        return x
    on = jnp.any(meta.repetition_penalty != 1.0)
    if meta.prompt_lens is not None:
        on |= jnp.any(meta.presence_penalty != 0.0) | jnp.any(meta.frequency_penalty != 0.0)
    return jax.lax.cond(on, lambda: _history_penalties(x, meta), lambda: x)


def apply_token_bitmask(logits: jax.Array, bitmask: jax.Array) -> jax.Array:
    """[B, V] ``logits`` with -inf where bit ``v % 32`` of ``bitmask[b, v // 32]`` is 0 (i32[B,
    W], W = ceil(V / 32), llguidance's layout; a row of -1: unchanged). Source: vLLM's
    ``apply_grammar_bitmask``, applied before the sampler (its logprobs see the mask)."""
    v = jnp.arange(logits.shape[1], dtype=jnp.int32)
    return jnp.where((bitmask[:, v // 32] >> (v % 32)) & 1 != 0, logits, -jnp.inf)


def apply_logits_processors(logits: jax.Array, meta: SamplingMetadata, processors) -> jax.Array:
    """f32[B, V]: processor j of ``processors`` (static) in turn on the rows whose
    ``processor_rows`` column j is 1, vLLM V0's per-request ``fn(output_token_ids, logits) ->
    logits`` vmapped over rows: the row's output ids as i32[R] then -1s (R static, the history
    length Lh of `jaxinfer.step_input`; the count is ``sum(ids >= 0)``), its f32[V] logits; as
    vLLM's,
    before the bitmask, penalties and sampling (whose logprobs see the processed logits)."""
    if not processors:
        return logits
    toks, r = meta.penalty_tokens, meta.penalty_tokens.shape[1]
    at = meta.prompt_lens[:, None] + jnp.arange(r)  # the outputs follow the prompt
    out = jnp.where(at < r, jnp.take_along_axis(toks, jnp.minimum(at, r - 1), axis=1), -1)
    for j, fn in enumerate(processors):
        new = jax.vmap(fn)(out, logits).astype(logits.dtype)
        logits = jnp.where(meta.processor_rows[:, j : j + 1] != 0, new, logits)
    return logits


def _min_p_keep(scaled: jax.Array, min_p: jax.Array) -> jax.Array:
    """bool[B, V] ``exp(scaled) >= clip(min_p, 0, 1)`` (top scaled logit 0), elementwise."""
    return jnp.exp(scaled) >= jnp.clip(min_p.astype(jnp.float32), 0.0, 1.0)[:, None]


def _filter_sorted(
    vals: jax.Array, top_k: jax.Array, top_p: jax.Array, min_p: jax.Array
) -> jax.Array:
    """Top-k, top-p, min-p on sorted f32[B, V]: dropped -> -inf, position 0 kept."""
    b, v = vals.shape
    pos = jax.lax.broadcasted_iota(jnp.int32, (b, v), 1)
    keep = pos < jnp.where(top_k <= 0, v, jnp.minimum(top_k, v)).astype(jnp.int32)[:, None]
    masked = jnp.where(keep, vals, -jnp.inf)
    e = jnp.exp(masked - jnp.where(jnp.isfinite(masked[:, :1]), masked[:, :1], 0.0))
    probs = e / jnp.maximum(jnp.sum(e, axis=-1, keepdims=True), jnp.finfo(jnp.float32).tiny)
    mass_before = (jnp.cumsum(probs, axis=-1) - probs).at[:, 0].set(0.0)
    tp = top_p.astype(jnp.float32)[:, None]
    keep &= ((mass_before < tp) | (tp >= 1.0)) & _min_p_keep(vals, min_p)
    keep |= pos == 0
    return jnp.where(keep, vals, -jnp.inf)


def _is_greedy(temperature: jax.Array) -> jax.Array:
    return ~(temperature >= GREEDY_EPS)  # NaN counts as greedy


def _scale(x: jax.Array, temperature: jax.Array) -> jax.Array:
    """f32[B, V] ``(x - max) / T`` (T = 1 on greedy rows); the top entry is exactly 0."""
    t = jnp.where(_is_greedy(temperature), 1.0, temperature.astype(jnp.float32))
    m = jnp.max(x, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    return (x - m) / t[:, None]


def _sort_desc(scaled: jax.Array) -> tuple[jax.Array, jax.Array]:
    ids = jax.lax.broadcasted_iota(jnp.int32, scaled.shape, 1)
    neg_sorted, sorted_ids = jax.lax.sort((-scaled, ids), dimension=1, is_stable=True, num_keys=1)
    return -neg_sorted, sorted_ids


def _penalised(logits: jax.Array, meta: SamplingMetadata) -> jax.Array:
    """Penalised f32 logits, NaN -> -inf, +inf -> largest float32 (``x - max`` never NaN)."""
    x = apply_penalties(logits, meta)
    return jnp.nan_to_num(x, nan=-jnp.inf, posinf=jnp.finfo(jnp.float32).max, neginf=-jnp.inf)


def _gumbel_noise(seeds: jax.Array, step_idx: jax.Array, v: int) -> jax.Array:
    """f32[B, V] standard Gumbel noise; row b uses key ``fold_in(key(seeds[b]), step_idx[b])``."""
    seeds = (
        jax.lax.bitcast_convert_type(seeds, jnp.uint32)
        if seeds.dtype == jnp.int32
        else seeds.astype(jnp.uint32)
    )

    def row(seed, step):
        key = jax.random.fold_in(jax.random.key(seed, impl=_PRNG_IMPL), step)
        return jax.random.gumbel(key, (v,), jnp.float32)

    return jax.vmap(row)(seeds, step_idx.astype(jnp.int32))


def sample(logits: jax.Array, meta: SamplingMetadata, *, all_greedy: bool) -> jax.Array:
    """i32[B] ids in [0, V) of ``logits`` [B, V]; ``all_greedy``: argmax (ValueError: shapes)."""
    _check_shapes(logits, meta)
    x = _penalised(logits, meta)
    greedy_tok = jnp.argmax(x, axis=-1).astype(jnp.int32)
    if all_greedy:
        return greedy_tok
    v, is_greedy = x.shape[1], _is_greedy(meta.temperature)
    scaled = _scale(x, meta.temperature)
    g = _gumbel_noise(meta.seeds, meta.step_idx, v)  # indexed by token id, not by rank

    def with_sort():
        vals, ids = _sort_desc(scaled)
        vals = _filter_sorted(vals, meta.top_k, meta.top_p, meta.min_p)
        pick = jnp.argmax(vals + jnp.take_along_axis(g, ids, axis=-1), axis=-1)
        return jnp.take_along_axis(ids, pick[:, None], axis=-1)[:, 0]

    def without_sort():  # exact when no sampled row has an active top-k or top-p
        kept = jnp.where(_min_p_keep(scaled, meta.min_p), scaled, -jnp.inf)
        return jnp.argmax(kept + g, axis=-1).astype(jnp.int32)

    k_on, p_on = (meta.top_k > 0) & (meta.top_k < v), ~(meta.top_p >= 1.0)
    tok = jax.lax.cond(jnp.any(~is_greedy & (k_on | p_on)), with_sort, without_sort)
    return jnp.where(is_greedy, greedy_tok, tok).astype(jnp.int32)


def logprobs(logits: jax.Array, tokens: jax.Array, k: int) -> dict:
    """Log-probabilities of the raw distribution ``log_softmax(logits)`` (float32; vLLM's
    "raw_logprobs") for ``logits`` [B, V] and chosen ``tokens`` i32[B] (clipped to [0, V)):
    {"logprobs": f32[B] of the token, "ranks": i32[B] (vLLM: the number of ids at least as
    likely, 1 = likeliest), "top_ids": i32[B, k], "top_logprobs": f32[B, k] (descending)}."""
    lp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    tokens = jnp.clip(tokens, 0, lp.shape[1] - 1)
    tok = jnp.take_along_axis(lp, tokens[:, None], axis=-1)
    if k == 1:  # max / argmax fuse with the softmax; top_k may sort the whole row
        top_lp, top_ids = jnp.max(lp, axis=-1, keepdims=True), jnp.argmax(lp, axis=-1)[:, None]
    else:
        top_lp, top_ids = jax.lax.top_k(lp, k)
    return dict(
        logprobs=tok[:, 0],
        ranks=jnp.sum(lp >= tok, axis=-1, dtype=jnp.int32),
        top_ids=top_ids.astype(jnp.int32),
        top_logprobs=top_lp,
    )
