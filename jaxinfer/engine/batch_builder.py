"""A `ScheduledBatch` as a padded, bucketed `HostBatch` (host side, no JAX; `step_input` schema)."""

import numpy as np

from jaxinfer.sampling_params import MAX_LOGPROBS
from jaxinfer.step_input import (
    INT32_MAX,
    BucketSpec,
    HostBatch,
    ShapeKey,
    allocate,
    bucket,
    powers_of_two,
)

LOGPROB_BUCKETS = (1, 5, MAX_LOGPROBS)  # top-k sizes compiled (ShapeKey.logprobs)


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


def build_host_batch(
    batch,
    *,
    page_size: int,
    buckets: BucketSpec,
    eos_token_ids=(),
    mask_words: int = 0,
    key: ShapeKey | None = None,
) -> HostBatch:
    """Pad a `ScheduledBatch` to a bucketed `HostBatch` (packed if a chunk has > 1 token;
    ``pending_input`` rows in ``pending_rows``; ``mask_words`` W: a bitmask i32[B, W], all -1, if
    a sampled row is constrained); ``key``: a shape that `covers` its `shape_key` instead.
    ValueError: a size past the largest bucket."""
    hb = allocate(
        key
        or shape_key(
            batch,
            page_size=page_size,
            buckets=buckets,
            eos_token_ids=eos_token_ids,
            mask_words=mask_words,
        )
    )
    a, off, j = hb.arrays, 0, 0  # off: packed offset of row i's first token; j: prompt position
    scored = _prompt_positions(batch) if hb.key.prompt_logprobs else [()] * batch.num_seqs
    for i, (s, n, c) in enumerate(zip(batch.seqs, batch.num_new_tokens, batch.start_positions)):
        for q in scored[i]:
            a["prompt_lp_index"][j] = (off if hb.key.packed else i * hb.key.tokens) + q - c
            a["prompt_lp_next"][j], hb.prompt_lp_rows[j], j = s.prompt_token_ids[q + 1], i, j + 1
        pos, table = np.arange(c, c + n, dtype=np.int32), np.asarray(s.block_table, np.int32)
        row_slots = table[pos // page_size] * page_size + pos % page_size
        if hb.key.packed:
            rows = slice(off, off + n)
            a["tokens"][0, rows] = s.all_token_ids[c : c + n]
            a["positions"][0, rows], a["slot_mapping"][0, rows] = pos, row_slots
            a["q_index"][i, :n] = np.arange(off, off + n)
            a["q_positions"][i, :n] = pos
            a["out_index"][rows] = i * hb.key.query + np.arange(n)
            a["logits_indices"][i] = off + n - 1
            off += n
        else:
            hb.pending_rows[i] = batch.pending_input[i]
            if not batch.pending_input[i]:
                a["tokens"][i, 0] = s.last_token_id if c == s.num_tokens - 1 else s.all_token_ids[c]
            a["positions"][i, 0], a["slot_mapping"][i, 0] = c, row_slots[0]
        npages = -(-(c + n) // page_size)
        a["block_tables"][i, :npages] = table[:npages]
        a["seq_lens"][i] = c + n
        p = s.params
        a["temperature"][i], a["top_p"][i], a["min_p"][i] = p.temperature, p.top_p, p.min_p
        a["top_k"][i] = min(p.top_k, INT32_MAX) if p.top_k > 0 else 0  # >= vocab: no cut
        a["repetition_penalty"][i] = p.repetition_penalty
        a["seeds"][i] = np.uint32((s.seed ^ (s.seed >> 32)) & 0xFFFFFFFF)  # fold int64 seeds
        a["step_idx"][i] = s.num_tokens_with_pending - s.num_prompt_tokens - 1  # outputs before
        if hb.key.penalty:
            a["penalty_tokens"][i, : s.num_tokens] = s.all_token_ids
            a["prompt_lens"][i] = s.num_prompt_tokens
            a["presence_penalty"][i], a["frequency_penalty"][i] = (
                p.presence_penalty,
                p.frequency_penalty,
            )
        if hb.key.processors:
            a["processor_rows"][i] = [f in (p.logits_processors or ()) for f in hb.key.processors]
        if hb.key.bias and (entries := _bias(s, eos_token_ids)):
            a["bias_ids"][i, : len(entries)], a["bias_values"][i, : len(entries)] = zip(*entries)
        hb.sample_rows[i] = batch.do_sample[i]
    return hb


def shape_key(
    batch, *, page_size: int, buckets: BucketSpec, eos_token_ids=(), mask_words: int = 0
) -> ShapeKey:
    """The bucketed `ShapeKey` of a `ScheduledBatch`. A packed step's M is the largest page
    bucket (its attention loops to each row's seq_len, so only the table's width pads): one
    shape per (B, Tp, Q) instead of one per M as well."""
    seqs, nums = batch.seqs, batch.num_new_tokens
    B = bucket(len(seqs), buckets.batch)
    M = bucket(
        max(-(-(c + n) // page_size) for c, n in zip(batch.start_positions, nums)), buckets.pages
    )
    penalised = any(s.params.needs_history for s in seqs)
    R = bucket(max(s.num_tokens for s in seqs), powers_of_two(16, 1 << 30)) if penalised else 0
    greedy = all(s.params.greedy for s in seqs)
    E = max(len(_bias(s, eos_token_ids)) for s in seqs)
    token_buckets = buckets.packed_tokens or buckets.prefill_tokens
    P = sum(len(r) for r in _prompt_positions(batch))
    k = max(
        [s.params.logprobs for s in seqs if s.params.logprobs is not None]
        + [s.params.prompt_logprobs for s in seqs if P and s.params.prompt_logprobs is not None],
        default=-1,
    )
    extra = dict(
        bias=E and bucket(E, powers_of_two(8, 1 << 30)),
        logprobs=0 if k < 0 else bucket(max(k, 1), LOGPROB_BUCKETS),
        prompt_logprobs=P and bucket(P, token_buckets),
        bitmask=mask_words
        if any(
            d and (s.params.structured_outputs or s.params.bad_words or s.params.allowed_token_ids)
            for s, d in zip(seqs, batch.do_sample)
        )
        else 0,
        processors=tuple(
            dict.fromkeys(
                f
                for s, d in zip(seqs, batch.do_sample)
                if d
                for f in s.params.logits_processors or ()
            )
        ),
    )
    if max(nums) == 1:
        return ShapeKey(B, 1, M, R, None, greedy, **extra)
    Tp = bucket(sum(nums), token_buckets)
    return ShapeKey(
        B, Tp, buckets.pages[-1], R, bucket(max(nums), buckets.prefill_tokens), greedy, **extra
    )
