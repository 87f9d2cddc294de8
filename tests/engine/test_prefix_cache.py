"""Prefix caching in the BlockManager and Scheduler (host only, no JAX): vLLM V1 semantics.

The fake device keeps the CONTENT of every KV slot (token id and position), writes only through
the block table and refuses to write into a page that is shared or published; to sample it reads
the whole context back through the block table and checks it against the sequence's tokens, so a
page shared with the wrong content, or reused while still cached, changes the context and fails.
The reference is each request generated alone (tests/engine/test_scheduler.py's
``reference_generate``); pages are accounted by an independent walk after every step. This module
holds the harness (`tests/engine/test_prefix_cache_scheduler.py` imports it) and the block
manager's tests.
"""

import random

import pytest

from jaxinfer.engine.block_manager import BlockManager
from jaxinfer.engine.scheduler import Scheduler
from jaxinfer.engine.sequence import Sequence
from jaxinfer.sampling_params import SamplingParams
from tests.engine.pages import cached_pages, check_pages, ref_count
from tests.engine.test_scheduler import (
    VOCAB,
    Batches,
    check_rows,
    fake_next_token,
    reference_generate,
)


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
    """Drive ``sched`` to the end on its device (kept across calls: the KV content persists);
    returns the `Batches` (rows checked by `check_rows`)."""
    if not hasattr(sched, "device"):
        sched.device = ContentDevice(sched)
    dev, batches, in_flight = sched.device, Batches(), []
    for step in range(max_steps):
        more = between(step, sched) if between else False  # arrivals still to come
        if not sched.has_unfinished() and not in_flight:
            if more:
                continue
            break
        running_before = list(sched.running)
        batch = sched.schedule()
        if batch is not None:
            batches.num_decode.append(check_rows(sched, batch, running_before))
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


def warm(P, system, **kw):
    """A scheduler whose cache holds ``system``'s full pages (one request ran on it)."""
    sched = make(128, P, **kw)
    sched.add(seq_of("warm", system + [9]))
    run(sched)
    return sched


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
