"""Scheduler: mixed steps (decode rows first, then prefill chunks, one token budget), chunked
prefill, batch limits and fairness (the harness is `tests/engine/test_scheduler.py`'s)."""

from tests.engine.test_scheduler import (
    add,
    assert_matches_reference,
    make,
    rows,
    run,
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
