"""Prefix caching in the BlockManager and Scheduler (host only, no JAX): vLLM V1 semantics.

The fake device keeps the CONTENT of every KV slot (token id and position), writes only through
the block table and refuses to write into a page that is shared or published; to sample it reads
the whole context back through the block table and checks it against the sequence's tokens, so a
page shared with the wrong content, or reused while still cached, changes the context and fails.
The reference is each request generated alone (tests/engine/test_scheduler.py's
``reference_generate``); pages are accounted by an independent walk after every step.
"""

import random

import pytest

from jaxinfer.engine.block_manager import BlockManager
from jaxinfer.engine.scheduler import Scheduler
from jaxinfer.engine.sequence import Sequence
from jaxinfer.sampling_params import SamplingParams
from tests.engine.pages import cached_pages, check_pages, ref_count
from tests.engine.test_scheduler import VOCAB, fake_next_token, reference_generate


class ContentDevice:
    def __init__(self, sched):
        self.sched, self.P, self.slots = sched, sched.page_size, {}
        self.sampled = {}

    def step(self, batch):
        bm, P, out = self.sched.block_manager, self.P, []
        for seq, start, n, samp in zip(
            batch.seqs, batch.start_positions, batch.num_new_tokens, batch.do_sample
        ):
            toks = seq.all_token_ids + self.sampled.get(id(seq), [])
            for pos in range(start, start + n):
                page = seq.block_table[pos // P]
                assert page != 0 and ref_count(bm, page) == 1, (seq, pos, "writes a shared page")
                assert bm._key[page] is None, (seq, pos, "writes a published page")
                self.slots[page * P + pos % P] = (toks[pos], pos)
            if not samp:
                out.append(None)
                continue
            ctx = [self.slots.get(seq.block_table[p // P] * P + p % P) for p in range(start + n)]
            assert ctx == [(t, p) for p, t in enumerate(toks)], seq
            tok = fake_next_token(toks)
            self.sampled.setdefault(id(seq), []).append(tok)
            out.append(tok)
        return out

    def postprocessed(self, batch, out):
        for seq, tok in zip(batch.seqs, out):
            if tok is not None:
                assert self.sampled[id(seq)].pop(0) == tok


def accounting(sched):
    """An independent walk: every page is free, cached-unreferenced or held, adding up."""
    bm = sched.block_manager
    holders = list(sched.running) + ([sched.prefilling] if sched.prefilling else [])
    held = {p for s in holders for p in s.block_table}
    counts = check_pages(bm)
    assert counts["used"] == len(held) and 0 not in held
    assert counts["free"] + counts["cached"] + counts["used"] == bm.num_usable_pages
    assert bm.num_free_pages == counts["free"] + counts["cached"]
    return counts


def run(sched, lag=0, max_steps=5000, between=None):
    """Drive ``sched`` to the end on its device (kept across calls: the KV content persists)."""
    if not hasattr(sched, "device"):
        sched.device = ContentDevice(sched)
    dev, batches, in_flight = sched.device, [], []
    for step in range(max_steps):
        more = between(step, sched) if between else False  # arrivals still to come
        if not sched.has_unfinished() and not in_flight:
            if more:
                continue
            break
        batch = sched.schedule()
        if batch is not None:
            in_flight.append((batch, dev.step(batch)))
            batches.append(batch)
        while len(in_flight) > (lag if batch is not None else 0):
            b, out = in_flight.pop(0)
            sched.postprocess(b, out)
            dev.postprocessed(b, out)
        accounting(sched)
    else:
        raise AssertionError("did not finish")
    counts = accounting(sched)
    assert counts["used"] == 0
    return batches


def make(num_pages, P, *, caching=True, max_num_seqs=8, budget=64, L=512):
    return Scheduler(
        BlockManager(num_pages, P, enable_prefix_caching=caching),
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        max_model_len=L,
        page_size=P,
    )


def seq_of(rid, prompt, **kw):
    kw.setdefault("max_tokens", 6)
    kw.setdefault("ignore_eos", True)
    return Sequence(rid, list(prompt), SamplingParams(**kw), 0)


def check_reference(sched, seqs):
    for s in seqs:
        out, reason = reference_generate(
            s.prompt_token_ids, s.params, sched.eos_token_ids, sched.max_model_len
        )
        assert (s.output_token_ids, s.finish_reason) == (out, reason), s


def toks(n, seed):
    rng = random.Random(seed)
    return [rng.randrange(VOCAB) for _ in range(n)]


# ---------------------------------------------------------------- block manager
def test_publish_match_share_and_lru_eviction():
    P = 4
    bm = BlockManager(6, P, enable_prefix_caching=True)  # 5 usable pages
    a = seq_of("a", toks(10, 1))  # 2 full pages + 2 tokens
    bm.allocate(a, 10)
    assert a.block_table == [1, 2, 3]
    assert bm.match_prefix(a, 2) == ([], False)
    bm.mark_pending(a, 0)
    b = seq_of("b", a.prompt_token_ids)
    assert bm.match_prefix(b, 2) == ([], True)  # a is computing page 0: pending
    bm.publish(a, 0, 2)
    assert cached_pages(bm) == 2 and bm.match_prefix(b, 2) == ([1, 2], False)
    assert bm.match_prefix(b, 1) == ([1], False)  # capped
    assert bm.can_allocate(b, 10, [1, 2])
    assert bm.allocate(b, 10, [1, 2]) == [4]  # shares 1, 2; its own last page
    assert (ref_count(bm, 1), ref_count(bm, 2), ref_count(bm, 3)) == (2, 2, 1)
    assert check_pages(bm) == {"free": 1, "cached": 0, "used": 4}
    bm.free(a)  # shared pages still held by b
    assert check_pages(bm) == {"free": 2, "cached": 0, "used": 3} and bm.owner(1) is b
    bm.free(b)  # freed tail first: 2 then 1 evictable
    assert check_pages(bm) == {"free": 3, "cached": 2, "used": 0} and bm.num_free_pages == 5
    assert bm.reset_prefix_cache() is True and cached_pages(bm) == 0
    # LRU: never-cached pages go first, then the least recently freed cached page
    bm.allocate(a, 10, bm.match_prefix(a, 2)[0])  # no hits after the reset
    bm.publish(a, 0, 2)
    bm.free(a)
    assert list(bm._evictable) == [2, 1]
    c = seq_of("c", toks(16, 2))
    assert bm.allocate(c, 16) == [3, 4, 5, 2]  # 3 free pages, then evicts page 2
    assert bm.match_prefix(a, 2) == ([1], False)  # page 0 still cached, page 1 gone
    assert check_pages(bm) == {"free": 0, "cached": 1, "used": 4}


def test_hit_on_evictable_page_counts_against_free_pages():
    P = 2
    bm = BlockManager(4, P, enable_prefix_caching=True)  # 3 usable
    a = seq_of("a", [1, 2, 3, 4, 5])
    bm.allocate(a, 5)
    bm.publish(a, 0, 2)
    bm.free(a)  # 2 cached + 1 free
    b = seq_of("b", [1, 2, 3, 4, 9, 9])
    hits, _ = bm.match_prefix(b, 2)
    assert hits == [1, 2] and bm.num_free_pages == 3
    # b needs 3 pages: 2 hits + 1 new = all 3; one more token would need a 4th
    assert bm.can_allocate(b, 6, hits) and not bm.can_allocate(b, 7, hits)
    with pytest.raises(RuntimeError, match="more pages"):
        bm.allocate(b, 7, hits)
    assert check_pages(bm) == {"free": 1, "cached": 2, "used": 0}  # nothing taken


def test_hash_collision_never_gives_wrong_pages(monkeypatch):
    import jaxinfer.engine.block_manager as mod

    monkeypatch.setattr(mod, "_chain", lambda parent, tokens: b"same")
    bm = BlockManager(8, 2, enable_prefix_caching=True)
    a, b = seq_of("a", [1, 2, 3]), seq_of("b", [1, 7, 3])
    bm.allocate(a, 3)
    bm.publish(a, 0, 1)
    assert bm.match_prefix(b, 1) == ([], False)  # equal hash, other tokens: a miss
    assert bm.match_prefix(seq_of("c", [1, 2, 5]), 1) == ([1], False)


def test_reset_refused_while_pages_held_and_double_free():
    bm = BlockManager(8, 2, enable_prefix_caching=True)
    a = seq_of("a", [1, 2, 3])
    bm.allocate(a, 3)
    bm.publish(a, 0, 1)
    assert bm.reset_prefix_cache() is False and cached_pages(bm) == 1
    bm.free(a)
    with pytest.raises(RuntimeError, match="holds no pages"):
        bm.free(a)
    assert check_pages(bm) == {"free": 6, "cached": 1, "used": 0}


def test_check_detects_a_corrupt_pool():
    bm = BlockManager(5, 2, enable_prefix_caching=True)
    bm._free.append(1)  # page 1 listed twice
    with pytest.raises(RuntimeError, match="two states"):
        check_pages(bm)


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
    pre = [(b.start_positions[0], b.num_new_tokens[0]) for b in batches if b.is_prefill]
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
    assert batches[0].is_prefill and batches[0].seqs[0] is b
    assert (batches[0].start_positions[0], batches[0].num_new_tokens[0]) == (3 * P, 1)


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


def _warm(P, system, **kw):
    """A scheduler whose cache holds ``system``'s full pages (one request ran on it)."""
    sched = make(128, P, **kw)
    sched.add(seq_of("warm", system + [9]))
    run(sched)
    return sched


def test_admission_serves_cached_prompts_first():
    P = 4
    system = toks(3 * P, 7)
    sched = _warm(P, system, budget=16)
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
    sched = _warm(P, system, budget=3)
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
