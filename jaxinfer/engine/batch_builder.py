"""A scheduled batch as a padded `HostBatch` (host side, no JAX; schema: `jaxinfer.step_input`)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from jaxinfer.engine.buckets import batch_buckets as default_batch_buckets
from jaxinfer.engine.buckets import bucket, powers_of_two
from jaxinfer.step_input import INT32_MAX, HostBatch, ShapeKey, allocate


@dataclass(frozen=True)
class BucketSpec:
    """Padded sizes of B, Tq, M and packed Tp (powers of two up to a quarter of the token budget,
    then its multiples); ``token_buckets`` replaces Tq's and Tp's."""

    batch: tuple[int, ...]
    prefill_tokens: tuple[int, ...]
    pages: tuple[int, ...]
    packed_tokens: tuple[int, ...] = ()

    @classmethod
    def build(cls, *, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int,
              page_size: int, batch_buckets: tuple[int, ...] = (),
              token_buckets: tuple[int, ...] = ()) -> "BucketSpec":
        max_pages = -(-max_model_len // page_size)
        top = max(16, max_num_batched_tokens)
        quarter = max(512, top // 4)
        fine = tuple(b for b in powers_of_two(16, quarter) if b < top)
        fine += tuple(range(quarter, top, quarter)) + (top,)
        return cls(
            batch=batch_buckets or default_batch_buckets(max_num_seqs),
            prefill_tokens=token_buckets or powers_of_two(16, top),
            pages=powers_of_two(1, max_pages),
            packed_tokens=token_buckets or tuple(sorted(set(fine))))


def build_host_batch(batch, *, page_size: int, buckets: BucketSpec) -> HostBatch:
    """Pad a `ScheduledBatch` to a bucketed `HostBatch` (packed if a chunk has > 1 token); a
    ``pending_input`` row's token stays 0, flagged in ``pending_rows``. Raises ValueError: a size
    exceeds the largest bucket."""
    hb = allocate(shape_key(batch, page_size=page_size, buckets=buckets))
    a, off = hb.arrays, 0  # off: packed offset of row i's first token
    for i, (s, n, c) in enumerate(zip(batch.seqs, batch.num_new_tokens, batch.start_positions)):
        pos = np.arange(c, c + n, dtype=np.int32)
        table = np.asarray(s.block_table, np.int32)
        row_slots = table[pos // page_size] * page_size + pos % page_size
        if hb.packed:
            rows = slice(off, off + n)
            a["tokens"][0, rows] = s.all_token_ids[c:c + n]
            a["positions"][0, rows], a["slot_mapping"][0, rows] = pos, row_slots
            a["q_index"][i, :n] = np.arange(off, off + n)
            a["q_positions"][i, :n] = pos
            a["out_index"][rows] = i * hb.key.query + np.arange(n)
            a["logits_indices"][i] = off + n - 1
            off += n
        else:
            if batch.pending_input[i]:
                hb.pending_rows[i] = True
            else:
                a["tokens"][i, 0] = (s.last_token_id if c == s.num_tokens - 1
                                     else s.all_token_ids[c])
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
            a["penalty_tokens"][i, :s.num_tokens] = s.all_token_ids
        hb.sample_rows[i] = batch.do_sample[i]
    return hb


def shape_key(batch, *, page_size: int, buckets: BucketSpec) -> ShapeKey:
    """The bucketed `ShapeKey` of a `ScheduledBatch`."""
    seqs, nums = batch.seqs, batch.num_new_tokens
    B = bucket(len(seqs), buckets.batch)
    M = bucket(max(-(-(c + n) // page_size) for c, n in zip(batch.start_positions, nums)),
               buckets.pages)
    penalised = any(s.params.repetition_penalty != 1.0 for s in seqs)
    R = bucket(max(s.num_tokens for s in seqs), powers_of_two(16, 1 << 30)) if penalised else 0
    greedy = all(s.params.greedy for s in seqs)
    if max(nums) == 1:
        return ShapeKey(B, 1, M, R, None, greedy)
    Tp = bucket(sum(nums), buckets.packed_tokens or buckets.prefill_tokens)
    return ShapeKey(B, Tp, M, R, bucket(max(nums), buckets.prefill_tokens), greedy)
