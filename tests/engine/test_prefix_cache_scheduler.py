"""Prefix caching in the Scheduler (host only, no JAX): hits at admission, pages pending while
computed, n samples, cache-aware admission order, and hits within mixed steps (the harness is
`tests/engine/test_prefix_cache.py`'s)."""

import random

import pytest

from jaxinfer.engine.scheduler import Scheduler
from jaxinfer.engine.sequence import Sequence
from jaxinfer.sampling_params import SamplingParams
from tests.engine.pages import cached_pages, check_pages, ref_count
from tests.engine.test_prefix_cache import (
    ContentDevice,
    check_reference,
    make,
    run,
    seq_of,
    toks,
    warm,
)


# ---------------------------------------------------------------- scheduler
@pytest.mark.parametrize("npages", [1, 2, 3])
def test_full_page_prompts_sent_twice_compute_their_last_page(npages):
    P = 4
    sched = make(64, P)
    prompt = toks(npages * P, npages)
    first = seq_of("a", prompt)
    sched.add(first)
    run(sched)
    again = seq_of("b", prompt)
    sched.add(again)
    batches = run(sched)
    pre = [(st, n) for r in batches.prefill_rows() for _, n, st, _ in r]
    assert pre == [((npages - 1) * P, P)]  # every page cached but the last
    assert again.num_cached_tokens == (npages - 1) * P and first.num_cached_tokens == 0
    check_reference(sched, [first, again])
    st = sched.block_manager.stats
    assert (st.prefix_cache_queries, st.prefix_cache_hits) == (2 * npages * P, (npages - 1) * P)


def test_same_prefix_in_one_step_waits_then_shares():
    P = 4
    sched = make(64, P, budget=256)
    system = toks(3 * P, 7)
    a, other, b = seq_of("a", system + [1, 2]), seq_of("x", toks(9, 8)), seq_of("b", system + [3])
    for s in (a, other, b):
        sched.add(s)
    first = sched.schedule()
    assert first.seqs == [a, other]  # b waits in place, x is admitted
    assert list(sched.waiting) == [b]
    assert cached_pages(sched.block_manager) == 0  # published only once the step ran
    sched.device = ContentDevice(sched)
    out = sched.device.step(first)
    sched.postprocess(first, out)
    sched.device.postprocessed(first, out)
    batches = run(sched)
    assert b.num_cached_tokens == 3 * P and a.num_cached_tokens == 0
    # the next step decodes a and x, and b joins it with its 3 pages shared: 1 token to compute
    assert batches[0].seqs == [a, other, b] and batches.num_decode[0] == 2
    assert (batches[0].start_positions[2], batches[0].num_new_tokens[2]) == (3 * P, 1)


def test_n_samples_hold_the_prompt_once():
    P = 4
    sched = make(64, P, budget=256)
    prompt = toks(3 * P + 2, 11)
    params = SamplingParams(max_tokens=3, ignore_eos=True, n=4)
    samples = [Sequence(f"{i}_r", prompt, params, 0, index=i, parent_id="r") for i in range(4)]
    for s in samples:
        sched.add(s)
    seen = []

    def between(step, sched):
        if all(s.block_table for s in samples):
            seen.append([list(s.block_table) for s in samples])

    run(sched, between=between)
    tables = seen[0]
    assert all(t[:3] == tables[0][:3] for t in tables)  # the 3 full prompt pages, once
    assert len({p for t in tables for p in t}) == 3 + 4  # + one own last page per sample
    assert [s.num_cached_tokens for s in samples] == [0, 3 * P, 3 * P, 3 * P]


def test_prompt_logprobs_takes_no_hits_but_publishes():
    P = 4
    sched = make(64, P)
    prompt = toks(2 * P + 1, 3)
    a = seq_of("a", prompt, prompt_logprobs=1)
    sched.add(a)
    run(sched)
    assert a.num_cached_tokens == 0 and cached_pages(sched.block_manager) >= 2
    b = seq_of("b", prompt, prompt_logprobs=0)
    sched.add(b)
    batches = run(sched)
    assert batches[0].start_positions[0] == 0 and b.num_cached_tokens == 0
    c = seq_of("c", prompt)
    sched.add(c)
    run(sched)
    assert c.num_cached_tokens == 2 * P


@pytest.mark.parametrize("lag", [0, 1])
@pytest.mark.parametrize("num_pages,budget", [(200, 64), (24, 16), (14, 32)])
def test_random_shared_prefix_workload_matches_reference(lag, num_pages, budget):
    """Shared system prompts, chunked prefill, eviction and preemption (small pools), with and
    without the asynchronous lag: outputs equal each request alone; accounting after every step."""
    P, rng = 4, random.Random(num_pages * 10 + lag)
    sched = make(num_pages, P, budget=budget, max_num_seqs=6, L=96)
    systems = [toks(rng.choice([4, 8, 11, 16]), 100 + i) for i in range(3)]
    seqs, pending = [], []
    for i in range(40):
        prompt = rng.choice(systems) + toks(rng.randrange(0, 9), 1000 + i)
        n = rng.choice([1, 1, 1, 3])
        params = SamplingParams(max_tokens=rng.randrange(1, 12), ignore_eos=True, n=n)
        pending.append(
            [Sequence(f"{j}_{i}", prompt, params, 0, index=j, parent_id=str(i)) for j in range(n)]
        )

    def between(step, sched):
        if pending and step % 3 == 0:
            for s in pending.pop(0):
                sched.add(s)
                seqs.append(s)
        return bool(pending)

    run(sched, lag=lag, between=between)
    assert len(seqs) >= 40
    check_reference(sched, seqs)
    st = sched.block_manager.stats
    assert st.prefix_cache_hits > 0
    if num_pages == 14:
        assert any(s.num_preemptions for s in seqs)


def test_caching_off_schedules_exactly_as_before():
    """Same workload with caching on over distinct prompts, and off: the same batches."""

    def batches(caching):
        sched = make(40, 4, caching=caching, budget=32, max_num_seqs=4)
        for i in range(12):
            sched.add(seq_of(str(i), toks(3 + 5 * i % 17, 500 + i), max_tokens=1 + i % 5))
        return [
            [(s.request_id, st, n) for s, st, n in zip(b.seqs, b.start_positions, b.num_new_tokens)]
            for b in run(sched)
        ]

    assert batches(True) == batches(False)
    off = make(40, 4, caching=False)
    a, b = seq_of("a", toks(9, 1)), seq_of("b", toks(9, 1))
    off.add(a)
    off.add(b)
    run(off)
    assert (a.num_cached_tokens, b.num_cached_tokens) == (0, 0)
    assert cached_pages(off.block_manager) == 0
    assert off.block_manager.stats.prefix_cache_queries == 0


def test_copy_free_plans_from_the_cache_of_now():
    """A dry run on `copy_free` schedules exactly what the real pool then does (cached pages
    hit in both); the copy leaves the original untouched and excludes held pages."""
    P = 4
    sched = make(30, P)
    system = toks(3 * P, 5)
    sched.add(seq_of("a", system + [1]))
    run(sched)
    held = seq_of("h", toks(2 * P, 6))
    sched.block_manager.allocate(held, 2 * P)
    bm = sched.block_manager
    busy = bm.copy_free()
    assert (busy.num_free_pages, cached_pages(busy)) == (bm.num_free_pages, 4)  # 19 tokens
    assert not any(ref_count(busy, p) for p in range(30))
    bm.free(held)
    copy = bm.copy_free()
    assert check_pages(copy) == check_pages(bm)
    want = [seq_of("b", system + [2]), seq_of("c", system[:P] + [3])]

    def batches(s):
        for w in want:
            s.add(Sequence(w.request_id, w.prompt_token_ids, w.params, 0))
        return [
            [(q.request_id, st, n) for q, st, n in zip(b.seqs, b.start_positions, b.num_new_tokens)]
            for b in run(s)
        ]

    dry = Scheduler(copy, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=512, page_size=P)
    dry.device = ContentDevice(dry)
    dry.device.slots = dict(sched.device.slots)  # the same K/V content
    assert batches(dry) == batches(sched)
    assert batches(dry)[0][0] == ("b", 3 * P, 1)


def test_admission_serves_cached_prompts_first():
    P = 4
    system = toks(3 * P, 7)
    sched = warm(P, system, budget=14)  # c and x0 take it all: x1 waits
    xs = [seq_of(f"x{i}", toks(12, 20 + i)) for i in range(2)]
    c = seq_of("c", system + [1, 2])
    for s in (*xs, c):
        sched.add(s)
    first = sched.schedule()
    assert first.seqs == [c, xs[0]]  # c overtakes the FIFO head: 2 tokens to compute
    assert first.num_new_tokens == [2, 12] and xs[1].num_passed_over == 1
    out = sched.device.step(first)  # the warm run's device: its KV content
    sched.postprocess(first, out)
    sched.device.postprocessed(first, out)
    run(sched)
    check_reference(sched, [*xs, c])


@pytest.mark.parametrize("limit", [2, 10**9])
def test_admission_overtakes_a_waiting_request_at_most_pass_limit_times(monkeypatch, limit):
    from jaxinfer.engine import scheduler as scheduler_module

    monkeypatch.setattr(scheduler_module, "PASS_LIMIT", limit)
    P = 4
    system = toks(3 * P, 7)
    sched = warm(P, system, budget=3)
    u = seq_of("u", toks(12, 30))
    cs = [seq_of(f"c{i}", system + [i, i + 1]) for i in range(5)]
    for s in (u, *cs):
        sched.add(s)
    batches = run(sched)
    first = {s.request_id: min(i for i, b in enumerate(batches) if s in b.seqs) for s in (u, *cs)}
    if limit == 2:  # two overtakes (c0 whole, c1's first chunk), then u goes first
        assert first["u"] < first["c2"] and u.num_passed_over == 2
    else:  # every cached request goes first
        assert first["u"] > first["c4"] and u.num_passed_over == 5
    check_reference(sched, [u, *cs])


@pytest.mark.parametrize("lag", [0, 1])
def test_prefix_hits_within_a_mixed_step(lag):
    """Cached prompts admitted beside a decoding sequence share their pages in the same step."""
    P = 4
    system = toks(3 * P, 7)
    sched = warm(P, system, budget=32)
    pages = sched.block_manager.match_prefix(seq_of("probe", system + [0]), 3)[0]
    d = seq_of("d", toks(6, 40), max_tokens=8)
    sched.add(d)
    first = sched.schedule()
    out = sched.device.step(first)
    sched.postprocess(first, out)
    sched.device.postprocessed(first, out)
    c1, c2 = seq_of("c1", system + [1, 2]), seq_of("c2", system + [3])
    sched.add(c1)
    sched.add(c2)
    hits = sched.block_manager.stats.prefix_cache_hits
    batch = sched.schedule()
    assert batch.seqs == [d, c1, c2] and batch.num_new_tokens == [1, 2, 1]
    assert batch.start_positions == [6, 3 * P, 3 * P]
    assert c1.block_table[:3] == c2.block_table[:3] == pages and len(pages) == 3
    assert (c1.num_cached_tokens, c2.num_cached_tokens) == (3 * P, 3 * P)
    assert sched.block_manager.stats.prefix_cache_hits == hits + 2 * 3 * P
    out = sched.device.step(batch)
    sched.postprocess(batch, out)
    sched.device.postprocessed(batch, out)
    batches = run(sched, lag=lag)
    assert batches[0].seqs == [d, c1, c2] and batches.num_decode[0] == 3
    check_reference(sched, [d, c1, c2])
