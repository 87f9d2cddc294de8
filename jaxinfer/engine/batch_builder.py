"""A `ScheduledBatch` as a padded `HostBatch` (host side, no JAX; the `step_input` schema): its
`StepShape` (`step_shape`) and arrays (`build_host_batch`)."""

import numpy as np

from jaxinfer.step_input import (
    BIAS_BUCKETS,
    INT32_MAX,
    BucketSpec,
    ForwardKey,
    HostBatch,
    SamplerKey,
    StepShape,
    allocate,
    bucket,
    names,
    rows_of,
)


def _bias(s, eos_token_ids) -> list[tuple[int, float]]:
    """``logit_bias``, and -inf at EOS and ``stop_token_ids`` below ``min_tokens`` outputs."""
    p = s.params
    out = list((p.logit_bias or {}).items())
    if s.num_tokens_with_pending - s.num_prompt_tokens - 1 < p.min_tokens:
        out += [(t, -np.inf) for t in sorted({*p.stop_token_ids, *eos_token_ids})]
    return out


def _prompt_positions(batch) -> list[range]:
    """Per row, the prompt positions scored this step (p scores token p + 1), not yet recorded."""
    out = []
    for s, n, c in zip(batch.seqs, batch.num_new_tokens, batch.start_positions):
        have = -1 if s.prompt_logprobs is None else len(s.prompt_logprobs)
        out.append(range(max(c, have - 1), min(c + n, s.num_prompt_tokens - 1) if have >= 0 else c))
    return out


def needs_full_sampler(s, eos_token_ids) -> bool:
    """Whether sequence ``s``'s next token needs the sampler's "full" level: a bias entry
    (`_bias`), a penalty, log-probabilities, a grammar, token rules or logits processors."""
    p = s.params
    return bool(_bias(s, eos_token_ids)) or bool(
        p.needs_history
        or p.logprobs is not None
        or p.structured_outputs
        or p.bad_words
        or p.allowed_token_ids
        or p.logits_processors
    )


def _level(batch, eos_token_ids) -> tuple[str, int]:
    """The sampler level (`step_input.LEVELS`) and bias entries E the sampled rows need."""
    rows = [s for s, d in zip(batch.seqs, batch.do_sample) if d] or batch.seqs
    if any(needs_full_sampler(s, eos_token_ids) for s in rows):
        E = max(len(_bias(s, eos_token_ids)) for s in rows)
        return "full", bucket(max(E, 1), BIAS_BUCKETS)
    return ("greedy" if all(s.params.greedy for s in rows) else "sample"), 0


def step_shape(batch, *, buckets: BucketSpec, eos_token_ids=()) -> StepShape:
    """The `StepShape` of a `ScheduledBatch`: a verify step if a row has drafts (T = the
    ``spec_tokens`` bucket), else decode if every row has one token (T = the row bucket), else
    ragged (T = the token bucket of the tokens), M the page bucket of its longest row (if the
    buckets have pages); the sampler at the forward's R rows and the level its sampled rows
    need; P scored prompt positions bucketed."""
    nums, ps = batch.num_new_tokens, buckets.page_size
    need = max(-(-(c + n) // ps) for c, n in zip(batch.start_positions, nums))
    M = bucket(need, buckets.pages) if buckets.pages else 0
    if batch.num_draft_tokens:
        fwd = ForwardKey(bucket(sum(nums), buckets.spec_tokens), False, M, buckets.spec)
    elif max(nums) == 1:
        fwd = ForwardKey(bucket(len(nums), buckets.batch), True, M)
    else:
        fwd = ForwardKey(bucket(sum(nums), buckets.tokens), False, M)
    level, E = _level(batch, eos_token_ids)
    procs = tuple(
        dict.fromkeys(
            f
            for s, d in zip(batch.seqs, batch.do_sample)
            if d
            for f in s.params.logits_processors or ()
        )
    )
    P = sum(len(r) for r in _prompt_positions(batch))
    return StepShape(
        fwd,
        SamplerKey(rows_of(fwd, buckets.sizes), level, E, procs, fwd.spec),
        P and bucket(P, buckets.prompt),
    )


def _forward_row(a: dict, hb: HostBatch, batch, i: int, off: int, page_size: int) -> None:
    """Row ``i``'s forward inputs: its tokens at ``off`` (the pending one from the device)."""
    s, n, c = batch.seqs[i], batch.num_new_tokens[i], batch.start_positions[i]
    pos, table = np.arange(c, c + n, dtype=np.int32), np.asarray(s.block_table, np.int32)
    toks, d = slice(off, off + n), batch.draft_token_ids[i]
    hb.pending_rows[i] = batch.pending_input[i]
    if d:  # the last token, then the drafts
        a["tokens"][toks] = [*s.all_token_ids[c : c + n - len(d)], *d]
    elif not batch.pending_input[i]:
        a["tokens"][toks] = s.all_token_ids[c : c + n]
    else:  # only the first token can be pending (a decode row: n == 1)
        a["tokens"][off + 1 : off + n] = s.all_token_ids[c + 1 : c + n]
    a["positions"][toks] = pos
    a["slot_mapping"][toks] = table[pos // page_size] * page_size + pos % page_size
    a["query_start_loc"][i + 1 :] = off + n
    npages = -(-(c + n) // page_size)
    a["block_tables"][i, :npages] = table[:npages]
    a["seq_lens"][i] = c + n
    a["lora_slots"][i] = s.lora_slot
    scored = off + n - 1 - len(d) + np.arange(a["logits_indices"].shape[1])
    a["logits_indices"][i] = np.minimum(scored, off + n - 1)  # the drafts' and the last


def _sampling_row(a: dict, hb: HostBatch, s, eos_token_ids) -> None:
    """One row's sampling inputs: ``a`` holds views of its row of each array (1-D: [1])."""
    p, key = s.params, hb.shape.sampler
    a["temperature"][...], a["top_p"][...], a["min_p"][...] = p.temperature, p.top_p, p.min_p
    a["top_k"][...] = min(p.top_k, INT32_MAX) if p.top_k > 0 else 0  # >= vocab: no cut
    a["seeds"][...] = np.uint32((s.seed ^ (s.seed >> 32)) & 0xFFFFFFFF)  # fold int64 seeds
    a["step_idx"][...] = s.num_tokens_with_pending - s.num_prompt_tokens - 1  # outputs before
    if key.level != "full":
        return
    a["repetition_penalty"][...] = p.repetition_penalty
    if p.needs_history or p.logits_processors:
        a["penalty_tokens"][: s.num_tokens] = s.all_token_ids
        a["prompt_lens"][...] = s.num_prompt_tokens
        a["presence_penalty"][...] = p.presence_penalty
        a["frequency_penalty"][...] = p.frequency_penalty
    if key.processors:
        a["processor_rows"][...] = [f in (p.logits_processors or ()) for f in key.processors]
    if entries := _bias(s, eos_token_ids):
        a["bias_ids"][: len(entries)], a["bias_values"][: len(entries)] = zip(*entries)


def build_host_batch(
    batch, *, page_size: int, buckets: BucketSpec, eos_token_ids=(), shape: StepShape | None = None
) -> HostBatch:
    """Pad a `ScheduledBatch` to a `HostBatch` of its `step_shape` (or ``shape``): rows in batch
    order over tokens laid out row after row; ``pending_input`` rows in ``pending_rows`` (the
    engine fills ``pending_src``). ValueError: a size past the largest bucket."""
    hb = allocate(
        shape or step_shape(batch, buckets=buckets, eos_token_ids=eos_token_ids), buckets.sizes
    )
    a, off, j = hb.arrays, 0, 0  # off: row i's first token; j: prompt position
    scored = _prompt_positions(batch) if hb.shape.prompt else [()] * batch.num_seqs
    sampling = [f for f in names("sampling") if f in a and f != "bitmask"]
    for i, (s, n, c) in enumerate(zip(batch.seqs, batch.num_new_tokens, batch.start_positions)):
        for q in scored[i]:
            a["prompt_lp_index"][j] = off + q - c
            a["prompt_lp_next"][j], hb.prompt_lp_rows[j], j = s.prompt_token_ids[q + 1], i, j + 1
        _forward_row(a, hb, batch, i, off, page_size)
        views = {f: a[f][i] if a[f].ndim == 2 else a[f][i : i + 1] for f in sampling}
        _sampling_row(views, hb, s, eos_token_ids)
        if "draft_tokens" in a and (d := batch.draft_token_ids[i]):
            a["draft_tokens"][i, : len(d)] = d
        hb.sample_rows[i] = batch.do_sample[i]
        off += n
    return hb
