"""Scheduler: mixed steps (decode rows first, then prefill chunks, one token budget), chunked
prefill, batch limits and fairness (the harness is `tests/engine/test_scheduler.py`'s)."""

import pytest

from jaxinfer.engine.scheduled_batch import ScheduledBatch
from jaxinfer.engine.sequence import Sequence
from jaxinfer.sampling_params import SamplingParams
from tests.engine.test_scheduler import (
    FakeDevice,
    add,
    assert_matches_reference,
    make,
    rows,
    run,
    schedule_checked,
    step_sync,
)


# ---------------------------------------------------------------- chunked prefill
def test_chunked_prefill_splits_long_prompt_and_only_last_chunk_samples():
    budget = 32
    sched = make(1 + 64, 8, budget=budget)
    a = add(sched, "a", 100, max_tokens=3, ignore_eos=True)
    batches = run(sched)
    prefills = [row for r in batches.prefill_rows() for row in r]
    chunks = [n for _, n, _, _ in prefills]
    assert chunks == [budget] * (100 // budget) + [100 % budget]
    assert [st for _, _, st, _ in prefills] == [budget * i for i in range(len(chunks))]
    assert [smp for _, _, _, smp in prefills] == [False] * (len(chunks) - 1) + [True]
    assert batches.num_decode == [0] * len(chunks) + [1, 1]  # then it decodes alone
    assert_matches_reference(sched, [a])


def test_partial_prefill_is_continued_first_and_shares_the_budget():
    budget = 32
    sched = make(1 + 64, 8, budget=budget)
    b = add(sched, "b", 10, max_tokens=2, ignore_eos=True)
    a = add(sched, "a", 100, max_tokens=2, ignore_eos=True)
    c = add(sched, "c", 5, max_tokens=2, ignore_eos=True)
    batches = run(sched)
    # FIFO, budget-cut chunks; each step: the decode rows, the partial prefill, then admission
    # with what is left ("a" takes the 22 tokens b leaves; then 31 beside b's decode row; "c"
    # joins a's last 15-token chunk); no cap on rows x longest chunk (the attention is ragged)
    assert [rows(x) for x in batches] == [
        [("b", 10, 0, True), ("a", 22, 0, False)],
        [("b", 1, 10, True), ("a", 31, 22, False)],
        [("a", 32, 53, False)],
        [("a", 15, 85, True), ("c", 5, 0, True)],
        [("a", 1, 100, True), ("c", 1, 5, True)],
    ]
    assert_matches_reference(sched, [a, b, c])


# ---------------------------------------------------------------- batch limits and fairness
def test_max_num_seqs_respected_and_fifo():
    sched = make(1 + 64, 4, max_num_seqs=3, budget=64)
    seqs = [
        add(sched, f"r{i}", 3 + (i * 5) % 7, max_tokens=4 + i % 3, ignore_eos=True)
        for i in range(10)
    ]
    batches = run(sched)
    assert max(b.num_seqs for b in batches) == 3
    admitted = [s.request_id for r in batches.prefill_rows() for s, _, st, _ in r if st == 0]
    assert admitted == [s.request_id for s in seqs]  # no preemption here: FIFO
    firsts = [s.first_token_time for s in seqs]
    assert firsts == sorted(firsts)
    assert_matches_reference(sched, seqs)


def test_strict_fifo_head_blocks_smaller_followers():
    P = 4
    sched = make(1 + 6, P, max_num_seqs=8, budget=64, L=64)
    a = add(sched, "a", 12, max_tokens=4, ignore_eos=True)  # 3 pages, up to 4
    big = add(sched, "big", 16, max_tokens=4, ignore_eos=True)  # 4 pages: waits for a
    small = add(sched, "small", 2, max_tokens=2, ignore_eos=True)  # would fit, must not jump ahead
    batches = run(sched)
    admitted = [s.request_id for r in batches.prefill_rows() for s, _, st, _ in r if st == 0]
    assert admitted == ["a", "big", "small"]
    assert_matches_reference(sched, [a, big, small])


# ---------------------------------------------------------------- mixed steps
def test_step_carries_the_running_decode_rows_then_a_waiting_prompt():
    sched = make(1 + 64, 4, budget=16)
    a = add(sched, "a", 5, max_tokens=6, ignore_eos=True)
    b = add(sched, "b", 3, max_tokens=6, ignore_eos=True)
    dev = FakeDevice(sched)
    batch, k = schedule_checked(sched)
    assert rows(batch) == [("a", 5, 0, True), ("b", 3, 0, True)] and k == 0
    step_sync(sched, dev, batch)
    c = add(sched, "c", 30, max_tokens=3, ignore_eos=True)
    batch, k = schedule_checked(sched)
    # decode rows first (one token each, admission order), c's chunk takes what is left
    assert k == 2 and rows(batch) == [("a", 1, 5, True), ("b", 1, 3, True), ("c", 14, 0, False)]
    assert sum(batch.num_new_tokens) == 16 and sched.prefilling is c
    step_sync(sched, dev, batch)
    batch, k = schedule_checked(sched)
    assert k == 2 and rows(batch) == [("a", 1, 6, True), ("b", 1, 4, True), ("c", 14, 14, False)]
    step_sync(sched, dev, batch)
    run(sched, dev)
    assert_matches_reference(sched, [a, b, c])


def test_budget_below_the_running_count_decodes_the_oldest_and_keeps_the_rest():
    sched = make(1 + 64, 4, budget=64)
    seqs = [add(sched, f"r{i}", 3, max_tokens=5, ignore_eos=True) for i in range(4)]
    dev = FakeDevice(sched)
    step_sync(sched, dev, schedule_checked(sched)[0])  # all four prefilled in one step
    sched.max_num_batched_tokens = 2
    late = add(sched, "late", 2, max_tokens=2, ignore_eos=True)
    tables = [list(s.block_table) for s in seqs]
    batch, k = schedule_checked(sched)
    assert k == 2 and rows(batch) == [("r0", 1, 3, True), ("r1", 1, 3, True)]
    # r2 and r3 stay running as they were (not preempted); no budget left to admit "late"
    assert sched.running == seqs and all(s.num_preemptions == 0 for s in seqs)
    assert [s.block_table for s in seqs[2:]] == tables[2:]
    assert [s.num_computed_tokens for s in seqs[2:]] == [3, 3]
    assert list(sched.waiting) == [late]
    step_sync(sched, dev, batch)
    batches = run(sched, dev)
    order = [[s.request_id for s in b.seqs] for b in batches]
    assert order[:4] == [["r0", "r1"]] * 3 + [["r2", "r3"]]  # oldest first until they end
    assert all(sum(b.num_new_tokens) <= 2 for b in batches)
    assert_matches_reference(sched, [*seqs, late])
    assert all(s.num_preemptions == 0 for s in [*seqs, late])


@pytest.mark.parametrize("lag", [0, 1])
def test_long_prompt_chunked_over_mixed_steps_while_others_decode(lag):
    budget = 16
    sched = make(1 + 64, 4, budget=budget)
    a = add(sched, "a", 4, max_tokens=40, ignore_eos=True)
    b = add(sched, "b", 6, max_tokens=40, ignore_eos=True)
    dev = FakeDevice(sched)
    step_sync(sched, dev, schedule_checked(sched)[0])
    long = add(sched, "long", 100, max_tokens=2, ignore_eos=True)
    batches = run(sched, dev, lag=lag)
    steps = [(x, x.seqs.index(long)) for x in batches if long in x.seqs]
    chunks = [(x.num_new_tokens[i], x.start_positions[i], x.do_sample[i]) for x, i in steps]
    chunks = chunks[: [smp for _, _, smp in chunks].index(True) + 1]  # its prefill, then decode
    # a and b decode in every step that carries one of its chunks, first; the chunk takes the rest
    assert [n for n, _, _ in chunks] == [14] * 7 + [2] and sum(n for n, _, _ in chunks) == 100
    assert [st for _, st, _ in chunks] == [14 * i for i in range(8)]
    assert [smp for _, _, smp in chunks] == [False] * 7 + [True]
    assert all(x.seqs[:3] == [a, b, long] for x, _ in steps[: len(chunks)])
    assert all(sum(x.num_new_tokens) <= budget for x in batches)
    assert_matches_reference(sched, [a, b, long])


@pytest.mark.parametrize("lag", [0, 1])
def test_partial_prefill_preempted_in_a_mixed_step_then_recomputed(lag):
    sched = make(1 + 6, 4, budget=8)
    a = add(sched, "a", 4, max_tokens=16, ignore_eos=True)  # 5 pages at its end
    long = add(sched, "long", 20, max_tokens=1, ignore_eos=True)  # 6 pages: waits for a's end
    dev, in_flight, events = FakeDevice(sched), [], []
    while sched.has_unfinished() or in_flight:
        partial = sched.prefilling
        batch, k = schedule_checked(sched)
        if batch is not None:
            if partial is long and sched.prefilling is None and long not in sched.running:
                # preempted for a's page: the step decodes only, nothing admitted
                assert k == batch.num_seqs and long not in batch.seqs
                assert sched.waiting[0] is long and not long.block_table
                events.append("preempted")
            elif long in batch.seqs and batch.start_positions[batch.seqs.index(long)] == 0:
                assert batch.seqs.index(long) >= k  # a prefill row, after the decode rows
                events.append("admitted")
            in_flight.append((batch, dev.step(batch)))
        while len(in_flight) > (lag if batch is not None else 0):
            done, out = in_flight.pop(0)
            sched.postprocess(done, out)
            dev.postprocessed(done, out)
    assert events[:3] == ["admitted", "preempted", "admitted"]
    assert long.num_preemptions >= 1 and a.num_preemptions == 0
    assert_matches_reference(sched, [a, long])


def test_async_mixed_batches_scheduled_twice_before_postprocess():
    sched = make(1 + 64, 4, budget=16)
    a = add(sched, "a", 5, max_tokens=4, ignore_eos=True)
    dev, flight = FakeDevice(sched), []

    def launch():
        batch, k = schedule_checked(sched)
        flight.append((batch, dev.step(batch)))
        return batch, k

    def read_back():
        batch, out = flight.pop(0)
        sched.postprocess(batch, out)
        dev.postprocessed(batch, out)

    b1, _ = launch()
    assert rows(b1) == [("a", 5, 0, True)]
    c = add(sched, "c", 20, max_tokens=3, ignore_eos=True)
    b2, k = launch()  # b1 in flight: a decodes on its pending token beside c's first chunk
    assert k == 1 and rows(b2) == [("a", 1, 5, True), ("c", 15, 0, False)]
    assert b2.pending_input == [True, False]
    read_back()
    b3, k = launch()  # c's last chunk samples its first token
    assert k == 1 and rows(b3) == [("a", 1, 6, True), ("c", 5, 15, True)]
    assert b3.pending_input == [True, False] and c in sched.running
    read_back()
    b4, k = launch()  # prefilled in the step before: c decodes on its pending token
    assert k == 2 and rows(b4) == [("a", 1, 7, True), ("c", 1, 20, True)]
    assert b4.pending_input == [True, True] and a.num_pending_tokens == 2
    with pytest.raises(RuntimeError, match="not postprocessed"):
        sched.schedule()  # two in flight
    read_back()
    read_back()
    run(sched, dev, lag=1)
    assert_matches_reference(sched, [a, c])


# ---------------------------------------------------------------- sampled ids
def test_emitted_checks_each_rows_ids():
    """A decode row gets one id (an int or a list of one), a verify row its accepted drafts in
    order then one more, a prefill chunk not at its end None; anything else is a ValueError."""

    def seq(name, prompt, computed):
        s = Sequence(name, list(range(1, prompt + 1)), SamplingParams(max_tokens=9), seed=0)
        s.num_computed_tokens = computed
        return s

    seqs = [seq("a", 3, 2), seq("b", 4, 3), seq("c", 10, 0)]
    batch = ScheduledBatch(seqs, [1, 3, 4], [[], [7, 8], []])
    assert batch.do_sample == [True, True, False]
    assert batch.emitted([5, [7, 9], None]) == [[5], [7, 9], []]
    assert batch.emitted([[5], [7, 8, 6], None]) == [[5], [7, 8, 6], []]
    for bad in (
        [None, [7], None],  # row 0 samples
        [[5, 6], [7], None],  # two ids, no drafts
        [5, [8, 9], None],  # not the drafts' order
        [5, [7, 8, 6, 1], None],  # more than the drafts and one
        [5, None, None],
        [5, [7], 3],  # a chunk before its end samples nothing
    ):
        with pytest.raises(ValueError, match="is invalid: expected"):
            batch.emitted(bad)
