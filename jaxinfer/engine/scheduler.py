"""Continuous-batching scheduler (host side; imports no JAX).

One engine step is ``batch = scheduler.schedule()`` -> device step -> ``scheduler.postprocess(batch,
sampled)``. Asynchronous scheduling: up to two batches may be in flight, i.e. the next step may be
scheduled (and dispatched) before the previous one is postprocessed; batches are postprocessed in
the order they were scheduled. ``schedule`` advances ``num_computed_tokens`` and counts the tokens
each row samples as *pending* (``Sequence.num_pending_tokens``); a decode row whose input is a
pending token is marked in ``ScheduledBatch.pending_input`` and the engine feeds it from the
previous step's device output. A sequence whose pending tokens will reach ``max_tokens`` or
``max_model_len`` is not scheduled again (it finishes when they are read back); one that finishes
on a stop/EOS token was possibly scheduled once more, and that row's result is dropped
(vLLM v1 async scheduling, SGLang's overlap scheduler).

Policy (nano-vllm style, with chunked prefill):
    * Prefill first. If sequences are waiting, the step is a PREFILL batch: the partially prefilled
      sequence (if any) is continued first, then waiting sequences are admitted in FIFO order while
      fewer than ``max_num_seqs`` sequences are admitted, the token budget
      ``max_num_batched_tokens`` is not spent, and the free list has the pages for the chunk. A
      sequence's chunk is its uncomputed tokens (prompt, plus the outputs it had before a
      preemption) capped by the remaining budget, so a long prompt is split over several steps
      (chunked prefill). Attention pads every row to the longest chunk, so rows x longest chunk
      is kept within twice the budget too (a later row's chunk is cut to fit, or the row waits). Only
      the chunk that reaches the end of the sequence samples a token. At most one sequence is
      partially prefilled at a time (the last row of its batch).
      FIFO is strict: if the head of the queue does not fit, nothing behind it is admitted.
    * Otherwise a DECODE batch of every decoding sequence, one token each. If one needs a new page
      and none is free, the most recently admitted sequence is preempted by recompute (its pages
      freed, ``num_computed_tokens = 0``, back to the FRONT of the waiting queue) and the
      allocation is retried. The partially prefilled sequence, if any, is always the most recently
      admitted one and so is the first victim.
    * Prefill and decode never mix in one batch.

Admission (``add``) guarantees that every sequence alone fits in the pool and in
``max_model_len``, so one sequence never has to preempt itself with nobody else left (no
livelock) and nothing is ever written at a position >= ``max_model_len``.

Sources: nano-vllm ``Scheduler`` (prefill-first, preempt-by-recompute from the back of the running
queue); vLLM chunked prefill (Agrawal et al. 2023, "SARATHI").
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Iterable

from jaxinfer.engine.block_manager import BlockManager
from jaxinfer.engine.sequence import Sequence, SequenceStatus

FINISH_REASONS = ("stop", "length", "abort")


@dataclass(frozen=True)
class ScheduledBatch:
    """The work of one engine step.

    Fields:
        seqs: the B sequences of the step, in batch order.
        num_new_tokens: per sequence, the tokens computed this step: positions
            ``[start_positions[i], start_positions[i] + num_new_tokens[i])`` of
            ``seqs[i].all_token_ids``. Decode: all 1.
        is_prefill: a prefill (chunk) batch; never mixed with decode.

    Derived at construction (snapshots, valid even after the sequences change):
        start_positions: ``seqs[i].num_computed_tokens`` when scheduled.
        do_sample: whether ``seqs[i]``'s chunk reaches the end of the sequence (pending tokens
            included), i.e. the step samples a token for it (``postprocess`` expects an int
            there, ``None`` elsewhere).
        pending_input: whether the token at ``start_positions[i]`` is a pending one (sampled by
            the batch in flight, id not known on the host): the engine takes it from that
            step's device output.

    Raises:
        ValueError: ``seqs`` and ``num_new_tokens`` differ in length, or a count is < 1.
    """

    seqs: list[Sequence]
    num_new_tokens: list[int]
    is_prefill: bool
    start_positions: list[int] = field(init=False)
    do_sample: list[bool] = field(init=False)
    pending_input: list[bool] = field(init=False)

    def __post_init__(self) -> None:
        # Own copies: the scheduler's queues change while the batch is in flight.
        object.__setattr__(self, "seqs", list(self.seqs))
        object.__setattr__(self, "num_new_tokens", [int(n) for n in self.num_new_tokens])
        if len(self.seqs) != len(self.num_new_tokens):
            raise ValueError(f"ScheduledBatch: {len(self.seqs)} seqs but "
                             f"{len(self.num_new_tokens)} num_new_tokens")
        if any(n < 1 for n in self.num_new_tokens):
            raise ValueError(f"ScheduledBatch.num_new_tokens={self.num_new_tokens} is invalid: "
                             "every count must be >= 1")
        starts = [s.num_computed_tokens for s in self.seqs]
        object.__setattr__(self, "start_positions", starts)
        object.__setattr__(self, "do_sample", [st + n == s.num_tokens_with_pending for s, st, n
                                               in zip(self.seqs, starts, self.num_new_tokens)])
        object.__setattr__(self, "pending_input", [st >= s.num_tokens for s, st in
                                                   zip(self.seqs, starts)])

    @property
    def num_seqs(self) -> int:
        return len(self.seqs)

    @property
    def total_new_tokens(self) -> int:
        return sum(self.num_new_tokens)


class Scheduler:
    """Decides which sequences run each step and owns their KV pages (via ``BlockManager``).

    Args:
        block_manager: the page allocator (its ``page_size`` must equal ``page_size``).
        max_num_seqs: the most admitted (page-holding) sequences, hence the largest batch.
        max_num_batched_tokens: token budget of one prefill step.
        max_model_len: the most tokens (prompt + output) one sequence may hold.
        page_size: tokens per KV page.
        eos_token_ids: the engine's end-of-sequence ids (finish reason "stop" unless the request
            sets ``ignore_eos``).

    Raises:
        ValueError: a non-positive size, or ``page_size`` differing from the block manager's.
    """

    def __init__(self, block_manager: BlockManager, *, max_num_seqs: int,
                 max_num_batched_tokens: int, max_model_len: int, page_size: int,
                 eos_token_ids: Iterable[int] = ()) -> None:
        for name, v in (("max_num_seqs", max_num_seqs),
                        ("max_num_batched_tokens", max_num_batched_tokens),
                        ("max_model_len", max_model_len), ("page_size", page_size)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"Scheduler.{name}={v!r} is invalid: must be a positive integer")
        if page_size != block_manager.page_size:
            raise ValueError(f"Scheduler.page_size={page_size} is invalid: must equal the block "
                             f"manager's page_size={block_manager.page_size}")
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.page_size = page_size
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        self.waiting: deque[Sequence] = deque()   # not admitted; no pages
        self.running: list[Sequence] = []         # decoding; admission order
        self.prefilling: Sequence | None = None   # partially prefilled; newest admitted
        self._requests: dict[str, Sequence] = {}  # unfinished, by request_id
        self._in_flight: deque[ScheduledBatch] = deque()  # scheduled, not postprocessed; oldest first

    # ------------------------------------------------------------------ queries
    @property
    def num_waiting(self) -> int:
        """Sequences queued and not admitted (holding no pages)."""
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        """Admitted sequences (holding pages): decoding plus the partially prefilled one."""
        return len(self.running) + (self.prefilling is not None)

    def has_unfinished(self) -> bool:
        return bool(self._requests)

    def get(self, request_id: str) -> Sequence | None:
        """The unfinished sequence with this id, or ``None``."""
        return self._requests.get(request_id)

    # ------------------------------------------------------------------ admission
    def check_admissible(self, n_prompt: int, params) -> None:
        """Raise ValueError if a request of ``n_prompt`` tokens with ``params`` can never run.

        Rule: ``n_prompt >= 1``, ``n_prompt + max_tokens <= max_model_len``, and the pages for
        ``n_prompt + max_tokens`` tokens fit in the whole pool. Used by `add` and by callers that
        validate a whole batch before queueing any of it.
        """
        max_tokens = params.max_tokens
        tokens = f"{n_prompt} token{'s' if n_prompt != 1 else ''}"
        if n_prompt == 0:
            raise ValueError("prompt has 0 tokens; at least 1 required")
        if n_prompt + max_tokens > self.max_model_len:
            raise ValueError(
                f"prompt has {tokens} and max_tokens={max_tokens}: prompt + max_tokens = "
                f"{n_prompt + max_tokens} exceeds max_model_len={self.max_model_len} (rule: prompt "
                f"tokens + max_tokens <= max_model_len)")
        need = self.block_manager.pages_needed(n_prompt + max_tokens)
        usable = self.block_manager.num_usable_pages
        if need > usable:
            raise ValueError(
                f"prompt has {tokens} and max_tokens={max_tokens}: needs {need} KV pages "
                f"of {self.page_size} tokens, but the whole KV pool has {usable} usable page{'s' if usable != 1 else ''} "
                f"({usable * self.page_size} tokens); lower max_tokens or enlarge the pool")

    def add(self, seq: Sequence) -> None:
        """Check ``seq`` and queue it (FIFO).

        Rule: ``len(prompt) + max_tokens <= max_model_len`` and the pages for
        ``len(prompt) + max_tokens`` tokens fit in the whole pool; a request that can never run
        is rejected here rather than left to livelock.

        Raises:
            ValueError: empty prompt; prompt + max_tokens > max_model_len; the worst-case pages
                exceed the pool; a duplicate unfinished ``request_id``; a sequence that is not
                fresh. The scheduler's state is unchanged then.
        """
        self.check_admissible(seq.num_prompt_tokens, seq.params)
        if seq.request_id in self._requests:
            raise ValueError(f"request_id={seq.request_id!r} is invalid: an unfinished request "
                             "with this id exists")
        if (seq.status is not SequenceStatus.WAITING or seq.block_table or seq.num_computed_tokens
                or seq.output_token_ids):
            raise ValueError(f"Sequence {seq.request_id!r} is invalid for add(): must be fresh "
                             f"(WAITING, no pages, no outputs), got {seq!r}")
        self._requests[seq.request_id] = seq
        self.waiting.append(seq)

    # ------------------------------------------------------------------ scheduling
    def schedule(self) -> ScheduledBatch | None:
        """Pick the next step's work (see the module docstring for the policy).

        Pages for every position the step writes are allocated before returning, and the
        batch's sequences are advanced: ``num_computed_tokens += num_new_tokens[i]`` and
        ``num_pending_tokens += 1`` where the row samples.

        Returns:
            The batch, or ``None`` when nothing can run until a batch in flight is postprocessed
            (or there is no unfinished sequence).

        Raises:
            RuntimeError: two batches are in flight already (postprocess the oldest first); or an
                internal invariant broke (work left, nothing in flight, nothing schedulable).
        """
        if len(self._in_flight) >= 2:
            raise RuntimeError("Scheduler.schedule: the previous batch was not postprocessed "
                               "(at most one batch may be in flight when scheduling)")
        batch = self._schedule_prefill() or self._schedule_decode()
        if batch is None:
            if self.has_unfinished() and not self._in_flight:
                raise RuntimeError(f"Scheduler.schedule: {len(self._requests)} unfinished requests "
                                   f"but nothing schedulable (waiting={self.num_waiting}, "
                                   f"free pages={self.block_manager.num_free_pages})")
            return None
        for seq, n, samp in zip(batch.seqs, batch.num_new_tokens, batch.do_sample):
            seq.num_computed_tokens += n
            seq.num_pending_tokens += samp
        self._in_flight.append(batch)
        return batch

    @property
    def num_in_flight(self) -> int:
        """Batches scheduled and not yet postprocessed (0, 1 or 2)."""
        return len(self._in_flight)

    def _schedule_prefill(self) -> ScheduledBatch | None:
        bm = self.block_manager
        seqs: list[Sequence] = []
        nums: list[int] = []
        budget = self.max_num_batched_tokens

        def take(seq: Sequence) -> bool:
            nonlocal budget
            if seq.num_pending_tokens:  # preempted with a token still in flight: next step
                return False
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            # Attention pads every row to the longest chunk (rows [R, Tq]; the projections and
            # the MLP run on the packed tokens only): keep rows x longest within twice the token
            # budget, so one long prompt does not blow 40 short ones up to [64, 1024]. Twice, not
            # once: on the throughput workload of scripts/plan_step_shapes.py that takes 19
            # prefill steps instead of 31 and pads 18% fewer tokens, for the same R x Tq x S.
            if seqs:
                cap = 2 * self.max_num_batched_tokens // (len(seqs) + 1)  # longest row allowed
                if max(nums) > cap:
                    return False
                n = min(n, cap)
            if not bm.can_allocate(seq, seq.num_computed_tokens + n):
                return False
            bm.allocate(seq, seq.num_computed_tokens + n)
            seq.status = SequenceStatus.RUNNING
            seqs.append(seq)
            nums.append(n)
            budget -= n
            if seq.num_computed_tokens + n == seq.num_tokens:
                self.running.append(seq)
            else:
                self.prefilling = seq      # budget is now 0: the last of this batch
            return True

        head, self.prefilling = self.prefilling, None
        if head is not None and not take(head):
            self.prefilling = head
            return None
        while (self.waiting and budget > 0 and self.prefilling is None
               and self.num_running < self.max_num_seqs):
            if not take(self.waiting[0]):
                break
            self.waiting.popleft()
        return ScheduledBatch(seqs, nums, is_prefill=True) if seqs else None

    def _finishes_on_length(self, seq: Sequence) -> bool:
        """Its pending tokens will end it on max_tokens or max_model_len: nothing more to run."""
        p = seq.num_pending_tokens
        return p > 0 and (seq.num_output_tokens + p >= seq.params.max_tokens
                          or seq.num_tokens + p >= self.max_model_len)

    def _schedule_decode(self) -> ScheduledBatch | None:
        if not self.running:
            return None
        bm = self.block_manager
        # admission order; victims come off the back. Sequences that end when their pending
        # tokens are read back keep their pages until then and are neither run nor preempted.
        ending: list[Sequence] = []
        queue: deque[Sequence] = deque()
        for s in self.running:
            (ending if self._finishes_on_length(s) else queue).append(s)
        scheduled: list[Sequence] = []
        deferred: list[Sequence] = []
        while queue:
            seq = queue.popleft()
            if seq.num_computed_tokens != seq.num_tokens_with_pending - 1:
                raise RuntimeError(f"Scheduler: decoding sequence out of step: {seq!r}")
            need = seq.num_computed_tokens + 1
            while not bm.can_allocate(seq, need):
                if self.prefilling is not None:
                    victim, self.prefilling = self.prefilling, None
                elif queue:
                    victim = queue.pop()
                elif scheduled:
                    victim = seq             # newest of the page holders left
                elif ending:
                    victim = None            # pages come back when the batch in flight ends
                else:
                    raise RuntimeError(f"Scheduler: {seq!r} alone does not fit the pool; "
                                       "admission should have rejected it")
                if victim is None:
                    deferred.append(seq)
                    break
                self._preempt(victim)
                if victim is seq:
                    break
            else:
                bm.allocate(seq, need)
                scheduled.append(seq)
        kept = {id(s) for s in scheduled + deferred + ending}
        self.running = [s for s in self.running if id(s) in kept]  # admission order
        if not scheduled:
            return None
        return ScheduledBatch(scheduled, [1] * len(scheduled), is_prefill=False)

    def _preempt(self, seq: Sequence) -> None:
        """Preempt by recompute: drop ``seq``'s K/V and queue it first."""
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.waiting.appendleft(seq)

    # ------------------------------------------------------------------ after the device step
    def postprocess(self, batch: ScheduledBatch, sampled: list[int | None]) -> list[Sequence]:
        """Advance the batch's sequences by the device step's results.

        For each sequence where ``batch.do_sample[i]``: the pending token becomes
        ``output_token_ids[-1]`` (``num_pending_tokens -= 1``), then, in this order: token in ``stop_token_ids`` or (not
        ``ignore_eos`` and token in the EOS ids) -> "stop"; ``len(output) >= max_tokens`` ->
        "length"; ``num_tokens >= max_model_len`` -> "length". Finished sequences leave the
        scheduler and free their pages. Sequences finished while the step ran (``abort``, a stop
        string, or a stop token read back from an earlier step) are skipped.

        Args:
            batch: the oldest batch in flight.
            sampled: B entries: the sampled token id where ``batch.do_sample[i]``, else ``None``.

        Returns:
            The sequences that finished in this call, in batch order.

        Raises:
            RuntimeError: ``batch`` is not the batch in flight.
            ValueError: ``sampled`` has the wrong length, or ``None``/an int where the other was
                expected (nothing is changed then).
        """
        if not self._in_flight or batch is not self._in_flight[0]:
            raise RuntimeError("Scheduler.postprocess: batch is not the one returned by the last "
                               "schedule() (the oldest batch in flight)")
        if len(sampled) != batch.num_seqs:
            raise ValueError(f"postprocess: sampled has {len(sampled)} entries, batch has "
                             f"{batch.num_seqs} sequences")
        for i, (tok, want) in enumerate(zip(sampled, batch.do_sample)):
            if (tok is None) == want:
                raise ValueError(f"postprocess: sampled[{i}]={tok!r} is invalid: expected "
                                 f"{'a token id' if want else 'None (prefill chunk not at the end)'}")
        self._in_flight.popleft()
        finished: list[Sequence] = []
        now = time.perf_counter()
        for seq, tok in zip(batch.seqs, sampled):
            if seq.is_finished or tok is None:
                continue
            tok = int(tok)
            seq.num_pending_tokens -= 1
            seq.output_token_ids.append(tok)
            if seq.first_token_time is None:
                seq.first_token_time = now
            reason = self._stop_reason(seq, tok)
            if reason is not None:
                self._finish(seq, reason, now)
                finished.append(seq)
        return finished

    def _stop_reason(self, seq: Sequence, tok: int) -> str | None:
        p = seq.params
        if tok in p.stop_token_ids or (not p.ignore_eos and tok in self.eos_token_ids):
            return "stop"
        if seq.num_output_tokens >= p.max_tokens:
            return "length"
        if seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    # ------------------------------------------------------------------ finishing from outside
    def finish(self, seq: Sequence, reason: str) -> bool:
        """Finish ``seq`` from outside (e.g. a stop string matched on decoded text) and free its
        pages.

        Returns:
            True, or False when ``seq`` had already finished (nothing changes then).

        Raises:
            ValueError: ``reason`` not in ("stop", "length", "abort"), or ``seq`` is not one of
                this scheduler's sequences.
        """
        if reason not in FINISH_REASONS:
            raise ValueError(f"finish reason={reason!r} is invalid: allowed {FINISH_REASONS}")
        if seq.is_finished:
            return False
        if self._requests.get(seq.request_id) is not seq:
            raise ValueError(f"Scheduler.finish: {seq!r} is not scheduled here")
        self._finish(seq, reason, time.perf_counter())
        return True

    def abort(self, request_id: str) -> Sequence | None:
        """Finish the unfinished request ``request_id`` with reason "abort".

        Returns:
            The aborted sequence, or ``None`` if no unfinished request has this id.
        """
        seq = self._requests.get(request_id)
        if seq is None:
            return None
        self._finish(seq, "abort", time.perf_counter())
        return seq

    def abort_all(self) -> list[Sequence]:
        """Abort every unfinished request and forget a batch that was never postprocessed (error
        recovery: an exception or interrupt between `schedule` and `postprocess`). All pages are
        returned to the free list."""
        self._in_flight.clear()
        return [s for rid in list(self._requests) if (s := self.abort(rid)) is not None]

    def _finish(self, seq: Sequence, reason: str, now: float) -> None:
        if seq is self.prefilling:
            self.prefilling = None
        elif seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        if seq.block_table:
            self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.finish_time = now
        del self._requests[seq.request_id]
