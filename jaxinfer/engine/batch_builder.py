"""A `ScheduledBatch` as a padded `HostBatch` (host side, no JAX; the `step_input` schema): its
`StepShape` (`step_shape`) and arrays (`build_host_batch`)."""

from itertools import chain

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
    rows_of,
)


def _below_min_tokens(s) -> bool:
    """Whether sequence ``s`` has fewer than ``min_tokens`` outputs before this step's token."""
    return s.num_tokens_with_pending - s.num_prompt_tokens - 1 < s.params.min_tokens


def _bias(s, eos_token_ids) -> list[tuple[int, float]]:
    """``logit_bias``, and -inf at EOS and ``stop_token_ids`` below ``min_tokens`` outputs."""
    p = s.params
    out = list((p.logit_bias or {}).items())
    if _below_min_tokens(s):
        out += [(t, -np.inf) for t in sorted({*p.stop_token_ids, *eos_token_ids})]
    return out


def _prompt_positions(batch) -> list[range]:
    """Per row, the prompt positions scored this step (p scores token p + 1), not yet recorded."""
    out = []
    for s, n, c in zip(batch.seqs, batch.num_new_tokens, batch.start_positions):
        if s.prompt_logprobs is None:
            out.append(range(c, c))
        else:
            have = len(s.prompt_logprobs)
            out.append(range(max(c, have - 1), min(c + n, s.num_prompt_tokens - 1)))
    return out


def needs_full_sampler(s, eos_token_ids) -> bool:
    """Whether sequence ``s``'s next token needs the sampler's "full" level: a bias entry
    (`_bias`), a penalty, log-probabilities, a grammar, token rules or logits processors."""
    p = s.params
    return bool(
        p.needs_history
        or p.logprobs is not None
        or p.structured_outputs
        or p.bad_words
        or p.allowed_token_ids
        or p.logits_processors
        or p.logit_bias
    ) or (_below_min_tokens(s) and bool(p.stop_token_ids or eos_token_ids))  # `_bias`'s


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


def _tokens(batch) -> list[int]:
    """The input tokens, row after row: a ``pending_input`` row's first one 0 (the device's
    ``pending_src`` fills it), a row's drafts after its last token."""
    out = []
    for s, c, n, d, pending in zip(
        batch.seqs,
        batch.start_positions,
        batch.num_new_tokens,
        batch.draft_token_ids,
        batch.pending_input,
    ):
        if d:
            out += [*s.token_ids(c, c + n - len(d)), *d]
        elif pending:  # only the first token can be pending (a decode row: n == 1)
            out += [0, *s.token_ids(c + 1, c + n)]
        else:
            out += s.token_ids(c, c + n)
    return out


def _forward_rows(a: dict, hb: HostBatch, batch, page_size: int) -> list[int]:
    """Every row's forward inputs at once, its tokens (`_tokens`) after the previous row's.
    Returns each row's first token's index."""
    seqs, B = batch.seqs, batch.num_seqs
    starts, nums = np.array(batch.start_positions), np.array(batch.num_new_tokens)
    ends = np.cumsum(nums)  # row i's tokens: [ends[i] - nums[i], ends[i])
    offs, total = ends - nums, int(ends[-1])
    row = np.repeat(np.arange(B), nums)  # each token's row
    pos = starts[row] + np.arange(total) - offs[row]
    npages = -(-(starts + nums) // page_size)
    tables = a["block_tables"][:B]
    tables[np.arange(tables.shape[1]) < npages[:, None]] = list(
        chain.from_iterable(s.block_table[:k] for s, k in zip(seqs, npages.tolist()))
    )
    a["tokens"][:total] = _tokens(batch)
    a["positions"][:total] = pos
    a["slot_mapping"][:total] = tables[row, pos // page_size] * page_size + pos % page_size
    a["query_start_loc"][1 : B + 1], a["query_start_loc"][B + 1 :] = ends, total
    a["seq_lens"][:B] = starts + nums
    a["lora_slots"][:B] = [s.lora_slot for s in seqs]
    last = ends[:, None] - 1  # the drafts' and the last token are scored
    drafts = np.array([len(d) for d in batch.draft_token_ids])[:, None]
    scored = last - drafts + np.arange(a["logits_indices"].shape[1])
    a["logits_indices"][:B] = np.minimum(scored, last)
    hb.pending_rows[:B] = batch.pending_input
    return offs.tolist()


def _sampling_rows(a: dict, hb: HostBatch, seqs, eos_token_ids) -> None:
    """Every row's sampling inputs: the per-row parameters of each level at once, then at level
    "full" each row's history, processors and bias entries."""
    B, ps = len(seqs), [s.params for s in seqs]
    a["temperature"][:B] = [p.temperature for p in ps]
    a["top_p"][:B] = [p.top_p for p in ps]
    a["min_p"][:B] = [p.min_p for p in ps]
    a["top_k"][:B] = [min(p.top_k, INT32_MAX) if p.top_k > 0 else 0 for p in ps]  # >= V: no cut
    a["seeds"][:B] = [(s.seed ^ (s.seed >> 32)) & 0xFFFFFFFF for s in seqs]  # fold int64 seeds
    a["step_idx"][:B] = [s.num_output_tokens + s.num_pending_tokens - 1 for s in seqs]  # before
    key = hb.shape.sampler
    if key.level != "full":
        return
    a["repetition_penalty"][:B] = [p.repetition_penalty for p in ps]
    for i, (s, p) in enumerate(zip(seqs, ps)):
        if p.needs_history or p.logits_processors:
            a["penalty_tokens"][i, : s.num_tokens] = s.all_token_ids
            a["prompt_lens"][i] = s.num_prompt_tokens
            a["presence_penalty"][i] = p.presence_penalty
            a["frequency_penalty"][i] = p.frequency_penalty
        if key.processors:
            a["processor_rows"][i] = [f in (p.logits_processors or ()) for f in key.processors]
        if entries := _bias(s, eos_token_ids):
            a["bias_ids"][i, : len(entries)], a["bias_values"][i, : len(entries)] = zip(*entries)


def _prompt_rows(a: dict, hb: HostBatch, batch, offs: list[int]) -> None:
    """The scored prompt positions (`_prompt_positions`; p scores token p + 1), row after row;
    ``offs``: each row's first token's index."""
    j = 0
    for i, (s, r) in enumerate(zip(batch.seqs, _prompt_positions(batch))):
        for q in r:
            a["prompt_lp_index"][j] = offs[i] + q - batch.start_positions[i]
            a["prompt_lp_next"][j], hb.prompt_lp_rows[j], j = s.prompt_token_ids[q + 1], i, j + 1


def build_host_batch(
    batch, *, page_size: int, buckets: BucketSpec, eos_token_ids=(), shape: StepShape | None = None
) -> HostBatch:
    """Pad a `ScheduledBatch` to a `HostBatch` of its `step_shape` (or ``shape``): rows in batch
    order over tokens laid out row after row; ``pending_input`` rows in ``pending_rows`` (the
    engine fills ``pending_src``). ValueError: a size past the largest bucket."""
    hb = allocate(
        shape or step_shape(batch, buckets=buckets, eos_token_ids=eos_token_ids), buckets.sizes
    )
    a = hb.arrays
    offs = _forward_rows(a, hb, batch, page_size)
    _sampling_rows(a, hb, batch.seqs, eos_token_ids)
    hb.sample_rows[: batch.num_seqs] = batch.do_sample
    if hb.shape.prompt:
        _prompt_rows(a, hb, batch, offs)
    if "draft_tokens" in a:
        for i, d in enumerate(batch.draft_token_ids):
            a["draft_tokens"][i, : len(d)] = d
    return hb
