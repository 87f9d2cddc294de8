"""Turn a scheduled batch into padded numpy step arrays (host side, no JAX).

Padding rules (the null-page invariant of jaxinfer/kv_cache.py): padded rows have ``seq_len 0``,
block-table entries 0 and tokens writing into slot 0 of the null page; padded tokens of a real row
also write into the null page and are never sampled.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from jaxinfer.engine.buckets import batch_buckets as default_batch_buckets
from jaxinfer.engine.buckets import bucket, powers_of_two

INT32_MAX = 2**31 - 1
GREEDY_EPS = 1e-5  # temperature below this is greedy (vLLM's _SAMPLING_EPS)


@dataclass(frozen=True)
class BucketSpec:
    """Padded sizes: batch rows B (`jaxinfer.engine.buckets.batch_buckets` unless
    ``batch_buckets`` is given), a prefill row's query tokens Tq, pages per row M, and the
    packed prefill tokens Tp (``packed_tokens``: powers of two up to a quarter of
    ``max_num_batched_tokens`` (at least 512), then its multiples, so a packed step pads less than
    a quarter of the budget with few compiled shapes; ``token_buckets`` replaces both lists)."""

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


@dataclass(frozen=True)
class HostBatch:
    """numpy arrays for one step; ``sample_rows`` marks rows whose sampled token is real;
    ``pending_rows`` marks rows whose input token (``tokens[i, 0]``, 0 here) is a pending one
    that the engine takes from the previous step's device output.

    Unpacked (decode, or every chunk 1 token): tokens/positions/slot_mapping are [B, T] with row
    b = sequence b, and the packing fields are None. Packed (prefill): they are [1, Tp], the
    rows' chunks back to back, and ``q_index``/``q_positions`` [R, Tq], ``out_index`` [Tp]
    describe the rows (`jaxinfer.models.common.Packing`); row arrays have R = B entries.
    """

    tokens: np.ndarray          # i32[B, T]
    positions: np.ndarray       # i32[B, T]
    slot_mapping: np.ndarray    # i32[B, T]
    logits_indices: np.ndarray  # i32[B]
    block_tables: np.ndarray    # i32[B, M]
    seq_lens: np.ndarray        # i32[B]
    temperature: np.ndarray     # f32[B]
    top_k: np.ndarray           # i32[B]   (0 = off)
    top_p: np.ndarray           # f32[B]
    min_p: np.ndarray           # f32[B]
    repetition_penalty: np.ndarray  # f32[B]
    seeds: np.ndarray           # u32[B]
    step_idx: np.ndarray        # i32[B]
    penalty_tokens: np.ndarray  # i32[B, R] (-1 padded; R = 0 when no row uses a penalty)
    sample_rows: np.ndarray     # bool[B]
    pending_rows: np.ndarray    # bool[B]
    all_greedy: bool
    q_index: np.ndarray | None = None      # i32[R, Tq]  (packed only)
    q_positions: np.ndarray | None = None  # i32[R, Tq]
    out_index: np.ndarray | None = None    # i32[Tp]

    @property
    def packed(self) -> bool:
        return self.q_index is not None

    @property
    def shape_key(self) -> tuple:
        """What a compiled step is specialised on."""
        return (self.tokens.shape, self.block_tables.shape, self.penalty_tokens.shape[1],
                None if self.q_index is None else self.q_index.shape, self.all_greedy)


def build_host_batch(batch, *, page_size: int, buckets: BucketSpec) -> HostBatch:
    """Pad a `ScheduledBatch` to a bucketed `HostBatch`.

    Row i computes positions ``[start, start + n)`` of ``batch.seqs[i]`` (``start =
    batch.start_positions[i]``, ``n = batch.num_new_tokens[i]``) and is sampled iff
    ``batch.do_sample[i]``. A row with ``batch.pending_input[i]`` (decode, n == 1) has its input
    token left at 0 and flagged in ``pending_rows``. Penalty tokens and ``step_idx`` count only
    tokens known on the host, so the engine schedules penalised rows synchronously. A batch with a
    chunk longer than 1 token is packed (see `HostBatch`): its tokens are padded once, at the end,
    to a ``prefill_tokens`` bucket, instead of every row to the longest chunk.

    Raises:
        ValueError: a size exceeds the largest bucket.
    """
    seqs, num_new_tokens = batch.seqs, batch.num_new_tokens
    n_rows = len(seqs)
    B = bucket(n_rows, buckets.batch)
    longest = max(num_new_tokens)
    packed = longest > 1
    kv_lens = [c + n for c, n in zip(batch.start_positions, num_new_tokens)]
    M = bucket(max(-(-k // page_size) for k in kv_lens), buckets.pages)

    if packed:
        Tp = bucket(sum(num_new_tokens), buckets.packed_tokens or buckets.prefill_tokens)
        Tq = bucket(longest, buckets.prefill_tokens)
        tokens = np.zeros((1, Tp), np.int32)
        positions = np.zeros((1, Tp), np.int32)
        slots = np.zeros((1, Tp), np.int32)
        q_index = np.zeros((B, Tq), np.int32)
        q_positions = np.zeros((B, Tq), np.int32)
        out_index = np.zeros((Tp,), np.int32)
    else:
        tokens = np.zeros((B, 1), np.int32)
        positions = np.zeros((B, 1), np.int32)
        slots = np.zeros((B, 1), np.int32)
        q_index = q_positions = out_index = None
    logits_idx = np.zeros((B,), np.int32)
    tables = np.zeros((B, M), np.int32)
    seq_lens = np.zeros((B,), np.int32)
    temperature = np.zeros((B,), np.float32)
    top_k = np.zeros((B,), np.int32)
    top_p = np.ones((B,), np.float32)
    min_p = np.zeros((B,), np.float32)
    rep = np.ones((B,), np.float32)
    seeds = np.zeros((B,), np.uint32)
    step_idx = np.zeros((B,), np.int32)
    sample_rows = np.zeros((B,), bool)
    pending_rows = np.zeros((B,), bool)
    use_penalty = any(s.params.repetition_penalty != 1.0 for s in seqs)
    R = bucket(max(s.num_tokens for s in seqs), powers_of_two(16, 1 << 30)) if use_penalty else 0
    penalty = np.full((B, R), -1, np.int32)

    off = 0  # packed offset of row i's first token
    for i, (s, n, c) in enumerate(zip(seqs, num_new_tokens, batch.start_positions)):
        pos = np.arange(c, c + n, dtype=np.int32)
        table = np.asarray(s.block_table, np.int32)
        row_slots = table[pos // page_size] * page_size + pos % page_size
        if packed:
            ids = s.all_token_ids
            tokens[0, off:off + n] = ids[c:c + n]
            positions[0, off:off + n] = pos
            slots[0, off:off + n] = row_slots
            q_index[i, :n] = np.arange(off, off + n)
            q_positions[i, :n] = pos
            out_index[off:off + n] = i * q_index.shape[1] + np.arange(n)
            logits_idx[i] = off + n - 1
            off += n
        else:
            if batch.pending_input[i]:
                pending_rows[i] = True
            else:
                tokens[i, 0] = s.last_token_id if c == s.num_tokens - 1 else s.all_token_ids[c]
            positions[i, 0] = c
            slots[i, 0] = row_slots[0]
        npages = -(-(c + n) // page_size)
        tables[i, :npages] = table[:npages]
        seq_lens[i] = c + n
        p = s.params
        temperature[i] = p.temperature
        top_k[i] = min(p.top_k, INT32_MAX) if p.top_k > 0 else 0  # >= vocab: no cut
        top_p[i] = p.top_p
        min_p[i] = p.min_p
        rep[i] = p.repetition_penalty
        seeds[i] = np.uint32((s.seed ^ (s.seed >> 32)) & 0xFFFFFFFF)  # fold int64 seeds
        step_idx[i] = s.num_tokens_with_pending - s.num_prompt_tokens - 1  # outputs before this one
        sample_rows[i] = batch.do_sample[i]
        if use_penalty:
            ids = s.all_token_ids
            penalty[i, :len(ids)] = ids
    all_greedy = all(s.params.temperature < GREEDY_EPS for s in seqs)
    return HostBatch(tokens, positions, slots, logits_idx, tables, seq_lens, temperature, top_k,
                     top_p, min_p, rep, seeds, step_idx, penalty, sample_rows, pending_rows,
                     all_greedy, q_index, q_positions, out_index)


# The step's device inputs, in packing order (`pack_device_inputs`); all 4-byte types. Packed-only
# fields are skipped when None. ``pending_src`` (i32[B], set by the engine) comes last.
DEVICE_FIELDS = ("tokens", "positions", "slot_mapping", "logits_indices", "block_tables",
                 "seq_lens", "temperature", "top_k", "top_p", "min_p", "repetition_penalty",
                 "seeds", "step_idx", "penalty_tokens", "q_index", "q_positions", "out_index")


def pack_device_inputs(hb: HostBatch, pending_src: np.ndarray | None = None
                       ) -> tuple[np.ndarray, tuple]:
    """Every device input of one step in a single int32 buffer, so the step costs one
    host-to-device transfer: on the H200 host, ~15 separate small transfers cost 1.7-3.7 ms per
    step and one packed buffer 0.3-0.6 ms (scripts/bench_transfers.py).

    Args:
        hb: the step's `HostBatch`.
        pending_src: i32[B] row of the previous step's output that is each row's input token, or
            -1 (`jaxinfer.step.StepInput`); None: all -1.
    Returns:
        (buffer i32[S], layout): float32 and uint32 fields are bit-cast, not converted; layout is
        ``((name, shape, dtype str), ...)`` in buffer order, hashable (a static argument of the
        jit step; `jaxinfer.step.unpack_step_inputs` reads it).
    """
    if pending_src is None:
        pending_src = np.full(hb.logits_indices.shape, -1, np.int32)
    parts, layout = [], []
    for name in DEVICE_FIELDS + ("pending_src",):
        a = pending_src if name == "pending_src" else getattr(hb, name)
        if a is None:
            continue
        a = np.ascontiguousarray(a)
        if a.dtype.itemsize != 4:
            raise TypeError(f"HostBatch.{name} has dtype {a.dtype}; device inputs are 4-byte")
        layout.append((name, a.shape, a.dtype.str))
        parts.append(a.view(np.int32).reshape(-1))
    return np.concatenate(parts), tuple(layout)


def empty_host_batch(shape_key: tuple) -> HostBatch:
    """An all-padding `HostBatch` whose ``shape_key`` is ``shape_key`` (for ahead-of-time
    compiles: only shapes and dtypes matter)."""
    tokens_shape, (B, M), R, q_shape, all_greedy = shape_key
    i32 = lambda *s: np.zeros(s, np.int32)  # noqa: E731
    f32 = lambda *s: np.zeros(s, np.float32)  # noqa: E731
    packed = q_shape is not None
    return HostBatch(
        i32(*tokens_shape), i32(*tokens_shape), i32(*tokens_shape), i32(B), i32(B, M), i32(B),
        f32(B), i32(B), f32(B), f32(B), f32(B), np.zeros((B,), np.uint32), i32(B), i32(B, R),
        np.zeros((B,), bool), np.zeros((B,), bool), bool(all_greedy),
        i32(*q_shape) if packed else None, i32(*q_shape) if packed else None,
        i32(tokens_shape[1]) if packed else None)
