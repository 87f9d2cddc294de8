"""Continuous-batching scheduler (host side, no JAX): ``schedule()`` -> step -> ``postprocess(batch,
sampled)``, at most two batches in flight (sampled tokens pending until read back). One batch per
step under one token budget, as vLLM V1: the running sequences' decode rows first (one token
each, oldest first; a missing page preempts the newest page holder, recompute), then prefill
chunks with the budget left (the partial prefill, then admission within ``max_num_seqs`` and free
pages; one partial chunk, last). Rows of any length mix (the attention is ragged). Prefix
caching: `_admission_order`, cached full pages shared (none for ``prompt_logprobs``), a sequence
whose next page is being computed waits in place. Sources: nano-vllm; vLLM V1 scheduler,
chunked prefill, prefix caching, async scheduling; SGLang."""

import time
from collections import deque
from collections.abc import Callable, Iterable

from jaxinfer.checks import check_int
from jaxinfer.engine.admission import check_admissible
from jaxinfer.engine.block_manager import BlockManager
from jaxinfer.engine.scheduled_batch import ScheduledBatch
from jaxinfer.engine.sequence import Sequence, SequenceStatus

FINISH_REASONS = ("stop", "length", "abort")
PASS_LIMIT = 256  # cache-aware admission: how many later requests may overtake a waiting one


class Scheduler:
    """Which sequences run each step; owns their pages. Speculative decoding: ``propose`` (the
    engine's: (decode rows, the most drafts each may get) -> {id(seq): drafts}) is asked, their
    pages allocated first, for up to ``spec_k`` drafts a row in a step whose decode rows and
    queued requests number fewer than ``spec_max_rows`` (vLLM's ``disable_by_batch_size``), and
    such a step carries at most ``spec_max_rows`` rows. ValueError: bad sizes or ``page_size``."""

    def __init__(
        self,
        block_manager: BlockManager,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        page_size: int,
        eos_token_ids: Iterable[int] = (),
        propose: Callable[[list[Sequence], list[int]], dict[int, list[int]]] | None = None,
        spec_max_rows: int = 0,
        spec_k: int = 0,
    ) -> None:
        for name, v in (
            ("max_num_seqs", max_num_seqs),
            ("max_num_batched_tokens", max_num_batched_tokens),
            ("max_model_len", max_model_len),
            ("page_size", page_size),
        ):
            check_int(f"Scheduler.{name}", v, 1)
        if page_size != block_manager.page_size:
            raise ValueError(
                f"Scheduler.page_size={page_size} is invalid: must equal the block "
                f"manager's page_size={block_manager.page_size}"
            )
        self.block_manager, self.max_num_seqs, self.page_size = (
            block_manager,
            max_num_seqs,
            page_size,
        )
        self.max_num_batched_tokens, self.max_model_len = max_num_batched_tokens, max_model_len
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        self.propose, self.spec_max_rows, self.spec_k = propose, spec_max_rows, spec_k
        self.waiting: deque[Sequence] = deque()  # not admitted; no pages
        self.running: list[Sequence] = []  # decoding; admission order
        self.prefilling: Sequence | None = None  # partially prefilled; newest admitted
        self._requests: dict[str, Sequence] = {}  # unfinished, by request_id
        self._in_flight: deque[ScheduledBatch] = deque()  # not postprocessed yet; oldest first

    num_waiting = property(lambda self: len(self.waiting))
    num_running = property(
        lambda self: len(self.running) + (self.prefilling is not None),
        doc="Admitted (page-holding) sequences, the partial prefill included.",
    )

    def has_unfinished(self) -> bool:
        return bool(self._requests)

    def get(self, request_id: str) -> Sequence | None:
        return self._requests.get(request_id)

    def check_admissible(self, n_prompt: int, params) -> None:
        """`admission.check_admissible` against this scheduler's length and pool."""
        check_admissible(n_prompt, params, self.max_model_len, self.block_manager)

    def add(self, seq: Sequence) -> None:
        """Queue ``seq`` (FIFO). ValueError (no change): inadmissible, duplicate id, not fresh."""
        self.check_admissible(seq.num_prompt_tokens, seq.params)
        if seq.request_id in self._requests:
            raise ValueError(
                f"request_id={seq.request_id!r} is invalid: an unfinished request "
                "with this id exists"
            )
        if (
            seq.status is not SequenceStatus.WAITING
            or seq.block_table
            or seq.num_computed_tokens
            or seq.output_token_ids
        ):
            raise ValueError(
                f"Sequence {seq.request_id!r} is invalid for add(): must be fresh "
                f"(WAITING, no pages, no outputs), got {seq!r}"
            )
        self._requests[seq.request_id] = seq
        self.waiting.append(seq)

    def schedule(self) -> ScheduledBatch | None:
        """The next batch (pages allocated, sequences advanced), or None: nothing runnable now.
        One token budget: decode rows first, then prefill chunks with what is left; no prefill
        in a step that preempted (a victim is not readmitted in the step that evicted it).
        Raises RuntimeError: two batches in flight, or work left that nothing can run."""
        if len(self._in_flight) >= 2:
            raise RuntimeError(
                "Scheduler.schedule: the previous batch was not postprocessed "
                "(at most one batch may be in flight when scheduling)"
            )
        seqs, nums, drafts, preempted = self._schedule_decode(self.max_num_batched_tokens)
        rows = self.spec_max_rows if any(drafts) else self.max_num_seqs
        if not preempted:
            self._schedule_prefill(seqs, nums, self.max_num_batched_tokens - sum(nums), rows)
        drafts += [[] for _ in range(len(seqs) - len(drafts))]
        if not seqs:
            if self.has_unfinished() and not self._in_flight:
                raise RuntimeError(
                    f"Scheduler.schedule: {len(self._requests)} unfinished requests "
                    f"but nothing schedulable (waiting={self.num_waiting}, "
                    f"free pages={self.block_manager.num_free_pages})"
                )
            return None
        batch = ScheduledBatch(seqs, nums, drafts)
        for seq, n, samp in zip(batch.seqs, batch.num_new_tokens, batch.do_sample):
            seq.num_computed_tokens += n
            seq.num_pending_tokens += samp
        self._in_flight.append(batch)
        return batch

    def _schedule_decode(self, budget: int) -> tuple[list, list[int], list[list[int]], bool]:
        """(the decode rows, oldest first, within ``budget`` tokens; their token counts; their
        drafts; whether a page holder was preempted). A row is a running sequence that can take
        one more token: those whose pending tokens end them (length) are skipped; a missing
        page preempts the newest page holder (the partial prefill, then the newest running,
        then the row itself), or defers the row when only ending sequences hold pages. Drafts
        (`_draft_room`) get their pages first, where they fit, then the proposer is asked
        (`_propose`). Those past the budget stay running, untouched."""
        bm = self.block_manager
        ending, queue, scheduled, deferred, preempted = [], deque(), [], [], False
        for s in self.running:
            p = s.num_pending_tokens
            ends = p > 0 and (
                s.num_output_tokens + p >= s.max_tokens or s.num_tokens + p >= self.max_model_len
            )
            (ending if ends else queue).append(s)
        room, used, most = self._draft_room(list(queue)), 0, []  # used: tokens scheduled
        while queue and used < budget:
            seq = queue.popleft()
            if seq.num_computed_tokens != seq.num_tokens_with_pending - 1:
                raise RuntimeError(f"Scheduler: decoding sequence out of step: {seq!r}")
            d = min(room.get(id(seq), 0), budget - used - 1)
            if d and not bm.can_allocate(seq, seq.num_computed_tokens + 1 + d):
                d = 0
            need = seq.num_computed_tokens + 1 + d
            while not bm.can_allocate(seq, need):
                if self.prefilling is not None:
                    victim, self.prefilling = self.prefilling, None
                elif queue:
                    victim = queue.pop()
                elif scheduled:
                    victim = seq  # newest of the page holders left
                elif ending:  # pages come back when the batch in flight ends
                    deferred.append(seq)
                    break
                else:
                    raise RuntimeError(
                        f"Scheduler: {seq!r} alone does not fit the pool; "
                        "admission should have rejected it"
                    )
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            else:
                bm.allocate(seq, need)
                scheduled.append(seq)
                used += 1 + d
                most.append(d)
        kept = {id(s) for s in (*scheduled, *deferred, *ending, *queue)}
        self.running = [s for s in self.running if id(s) in kept]  # admission order
        drafts = self._propose(scheduled, most)
        return scheduled, [1 + len(d) for d in drafts], drafts, preempted

    def _draft_room(self, rows: list[Sequence]) -> dict[int, int]:
        """{id(seq): the most drafts it may get}: ``spec_k``, cut to what the row may still emit
        less one (max_tokens, max_model_len); none while the decode rows and the requests
        waiting for admission number ``spec_max_rows`` or more (admission is never held back
        by speculation), for rows with a token in flight, or without a proposer."""
        queued = len(self.waiting) + (self.prefilling is not None)
        if self.propose is None or len(rows) + queued >= self.spec_max_rows:
            return {}
        room = {
            id(s): min(
                self.spec_k,
                s.max_tokens - s.num_output_tokens - 1,
                self.max_model_len - s.num_tokens - 1,
            )
            for s in rows
            if not s.num_pending_tokens
        }
        return {key: d for key, d in room.items() if d > 0}

    def _propose(self, rows: list[Sequence], most: list[int]) -> list[list[int]]:
        """Each row's drafts from ``propose`` (pages for ``most`` of them allocated), cut."""
        if not any(most):
            return [[] for _ in rows]
        asked = [(s, d) for s, d in zip(rows, most) if d]
        got = self.propose([s for s, _ in asked], [d for _, d in asked])
        return [[int(t) for t in got.get(id(s), [])[:d]] for s, d in zip(rows, most)]

    def may_speculate(self) -> bool:
        """Whether the next step may carry drafts (its rows need this step's tokens first)."""
        queued = len(self.waiting) + (self.prefilling is not None)
        return self.propose is not None and len(self.running) + queued < self.spec_max_rows

    def _preempt(self, victim: Sequence) -> None:
        """Free ``victim``'s pages; it is recomputed from its first token once readmitted (first
        in the queue; callers take it out of ``running`` / ``prefilling``)."""
        self.block_manager.free(victim)
        victim.num_computed_tokens, victim.status = 0, SequenceStatus.WAITING
        victim.num_preemptions += 1
        self.waiting.appendleft(victim)

    def _schedule_prefill(
        self, seqs: list[Sequence], nums: list[int], budget: int, rows: int
    ) -> None:
        """Append prefill rows to ``seqs``/``nums`` within ``budget`` tokens and ``rows`` rows:
        the partial prefill first (if it gets no pages, nothing else is admitted), then
        admission in `_admission_order` while fewer than ``max_num_seqs`` hold pages; a chunk
        cut by the budget becomes the partial prefill and ends the step's admissions (one
        partial at a time)."""

        def place(seq: Sequence, n: int) -> int:
            seqs.append(seq)
            nums.append(n)
            if seq.num_computed_tokens + n == seq.num_tokens:
                self.running.append(seq)
            else:
                self.prefilling = seq
            return budget - n

        head, self.prefilling = self.prefilling, None
        if head is not None:
            if budget <= 0 or len(seqs) >= rows or not (n := self._take(head, budget)):
                self.prefilling = head
                return
            budget = place(head, n)
        admitted = []
        for seq in self._admission_order():
            full = self.num_running >= self.max_num_seqs or len(seqs) >= rows
            if budget <= 0 or self.prefilling is not None or full:
                break
            if (n := self._take(seq, budget)) is None:
                continue  # its next prompt page is being computed: it waits in place
            if not n:
                break
            budget = place(seq, n)
            admitted.append(seq)
        self._remove_admitted(admitted)

    def _take(self, seq: Sequence, budget: int) -> int | None:
        """Give ``seq`` (waiting, or the partial prefill) its next chunk of at most ``budget`` >= 1
        tokens: pages allocated (prefix-cache hits shared at admission), RUNNING, its
        ``num_computed_tokens`` at the chunk's start. Returns the chunk's length; 0: not now (a
        token still in flight, or no pages); None: its next prompt page is being computed."""
        bm = self.block_manager
        if seq.num_pending_tokens:  # preempted with a token still in flight: next step
            return 0
        hits, admit = [], seq.num_computed_tokens == 0
        lookup = admit and bm.enable_prefix_caching and seq.params.prompt_logprobs is None
        if lookup:  # never a shared page written: the last token is always computed
            hits, pending = bm.match_prefix(seq, (seq.num_tokens - 1) // self.page_size)
            if pending:
                return None
        start = seq.num_computed_tokens + len(hits) * self.page_size
        n = min(seq.num_tokens - start, budget)
        if not bm.can_allocate(seq, start + n, hits):
            return 0
        bm.allocate(seq, start + n, hits)
        if lookup:
            bm.stats.prefix_cache_queries += seq.num_tokens
            bm.stats.prefix_cache_hits += start
            if not seq.num_preemptions:
                seq.num_cached_tokens = start
        if admit and bm.enable_prefix_caching:
            bm.mark_pending(seq, len(hits))
        seq.num_computed_tokens, seq.status = start, SequenceStatus.RUNNING
        return n

    def _admission_order(self) -> list[Sequence]:
        """The waiting queue in admission order. With prefix caching: the preempted and those
        overtaken `PASS_LIMIT` times, then those whose first prompt page is cached (cheap to
        prefill: served first, mean TTFT drops), then the rest, each FIFO. Else FIFO."""
        if not self.block_manager.enable_prefix_caching:
            return list(self.waiting)
        cached = self.block_manager.first_page_cached

        def rank(s: Sequence) -> int:
            return 0 if s.num_preemptions or s.num_passed_over >= PASS_LIMIT else 2 - cached(s)

        return sorted(self.waiting, key=rank)

    def _remove_admitted(self, admitted: list[Sequence]) -> None:
        """Drop ``admitted`` from the queue; each one left behind counts those queued after it."""
        taken, behind, kept = {id(s) for s in admitted}, len(admitted), deque()
        for seq in self.waiting:
            behind -= id(seq) in taken
            if id(seq) not in taken:
                seq.num_passed_over += behind
                kept.append(seq)
        self.waiting = kept

    def postprocess(self, batch: ScheduledBatch, sampled: list) -> list[Sequence]:
        """Append ``sampled`` (where ``batch.do_sample``: a token id, or for a row with drafts
        the list of its 1 .. drafts + 1 emitted ids; else None) for the oldest batch in flight;
        a row's rejected drafts are uncomputed again (their K/V slots are rewritten later). A
        stop token (EOS unless ``ignore_eos``) -> "stop", then "length"; tokens after the end
        are dropped. Returns the finished. Raises RuntimeError: not the oldest batch;
        ValueError: bad ``sampled``."""
        if not self._in_flight or batch is not self._in_flight[0]:
            raise RuntimeError(
                "Scheduler.postprocess: batch is not the one returned by the last "
                "schedule() (the oldest batch in flight)"
            )
        emitted = batch.emitted(sampled)
        self._in_flight.popleft()
        finished, now, P = [], time.perf_counter(), self.page_size
        for seq, st, n, d, toks in zip(
            batch.seqs, batch.start_positions, batch.num_new_tokens, batch.draft_token_ids, emitted
        ):
            if seq.is_finished:
                continue
            written = n - (len(d) + 1 - len(toks)) if d else n  # less the rejected drafts
            running = seq.status is SequenceStatus.RUNNING  # else preempted since
            if running:
                seq.num_computed_tokens -= n - written
            seq.num_pending_tokens -= bool(toks)
            reason = self._append(seq, toks, now)
            hi = min(st + written, seq.num_tokens) // P  # pages whose K/V is written now
            if running and self.block_manager.enable_prefix_caching and st // P < hi:
                self.block_manager.publish(seq, st // P, hi)
            if reason is not None:
                self._finish(seq, reason, now)
                finished.append(seq)
        return finished

    def _append(self, seq: Sequence, toks: list[int], now: float) -> str | None:
        """Append ``toks`` to ``seq``'s outputs up to its end; the finish reason, or None."""
        p = seq.params
        for tok in toks:
            seq.output_token_ids.append(tok)
            if seq.first_token_time is None:
                seq.first_token_time = now
            if tok in p.stop_token_ids or (not p.ignore_eos and tok in self.eos_token_ids):
                return "stop"
            if seq.num_output_tokens >= seq.max_tokens or seq.num_tokens >= self.max_model_len:
                return "length"
        return None

    def finish(self, seq: Sequence, reason: str) -> bool:
        """Finish ``seq`` (stop string); False if finished. ValueError: bad ``reason``, not ours."""
        if reason not in FINISH_REASONS:
            raise ValueError(f"finish reason={reason!r} is invalid: allowed {FINISH_REASONS}")
        if seq.is_finished:
            return False
        if self._requests.get(seq.request_id) is not seq:
            raise ValueError(f"Scheduler.finish: {seq!r} is not scheduled here")
        self._finish(seq, reason, time.perf_counter())
        return True

    def abort(self, request_id: str) -> Sequence | None:
        """Finish ``request_id`` with "abort"; the sequence, or None if not unfinished."""
        if (seq := self._requests.get(request_id)) is not None:
            self._finish(seq, "abort", time.perf_counter())
        return seq

    def abort_all(self) -> list[Sequence]:
        """Abort every unfinished request and forget the batches in flight."""
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
        seq.status, seq.finish_reason, seq.finish_time = SequenceStatus.FINISHED, reason, now
        del self._requests[seq.request_id]
