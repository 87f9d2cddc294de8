"""Scheduler: pure host simulation with a fake device (no JAX). This module holds the harness
(the other ``test_scheduler_*.py`` import it) and the admission, misuse and design-rule tests.

The fake device stands in for the model and the KV cache:
  * it "writes K/V" by storing, per physical slot ``page * P + offset``, the token id and the
    writer (sequence, preemption generation); every write goes through the sequence's block table;
  * to sample, it reads the whole context back THROUGH THE BLOCK TABLE, checks that every position
    was written by this sequence since its last preemption (so a recompute must cover prompt +
    outputs), and returns ``fake_next_token(context)``, a hash of the context.
  * it executes a batch when it is dispatched (right after ``schedule()``), like a GPU stream,
    and knows the tokens it sampled before the host reads them back: with asynchronous
    scheduling (``lag=1``) the next batch is scheduled and run before the previous one is
    postprocessed, and a row whose input is such a pending token gets it from the device.
The reference is ``reference_generate``: each request generated alone, straight from its token
list, with the documented stop rule. A scheduler that loses, clobbers or mis-positions K/V, or
mis-orders tokens, changes the sampled ids and fails the comparison.
"""

import ast
import pathlib
import random
import zlib

import pytest

from jaxinfer.engine.block_manager import BlockManager
from jaxinfer.engine.scheduled_batch import ScheduledBatch
from jaxinfer.engine.scheduler import Scheduler
from jaxinfer.engine.sequence import Sequence, SequenceStatus
from jaxinfer.sampling_params import SamplingParams

VOCAB = 1009


def fake_next_token(ctx):
    h = len(ctx)
    for t in ctx:
        h = (h * 1000003 + t + 1) % 2305843009213693951
    return h % VOCAB


def reference_generate(prompt, params, eos, max_model_len):
    """The documented stop rule applied to one request alone."""
    toks, out = list(prompt), []
    while True:
        t = fake_next_token(toks)
        out.append(t)
        toks.append(t)
        if t in params.stop_token_ids or (not params.ignore_eos and t in eos):
            return out, "stop"
        if len(out) >= params.max_tokens or len(toks) >= max_model_len:
            return out, "length"


class FakeDevice:
    def __init__(self, sched):
        self.sched = sched
        self.P = sched.page_size
        self.cache = {}  # slot -> (token, seq, generation)
        self.max_pos = -1
        self.sampled = {}  # id(seq) -> tokens sampled here, not yet postprocessed

    def postprocessed(self, batch, out):
        """The host read ``out`` back: those tokens are no longer only on the device."""
        for seq, tok in zip(batch.seqs, out):
            if tok is not None:
                assert self.sampled[id(seq)].pop(0) == tok

    def step(self, batch, script=None):
        P, bm, out = self.P, self.sched.block_manager, []
        for seq, start, n, samp, pend in zip(
            batch.seqs,
            batch.start_positions,
            batch.num_new_tokens,
            batch.do_sample,
            batch.pending_input,
        ):
            toks = seq.all_token_ids + self.sampled.get(id(seq), [])
            assert len(toks) == seq.num_tokens_with_pending - samp
            assert start + n == seq.num_computed_tokens and start + n <= len(toks)
            assert pend == (start >= seq.num_tokens)
            for pos in range(start, start + n):
                page = seq.block_table[pos // P]
                assert page != 0 and bm.owner(page) is seq
                self.cache[page * P + pos % P] = (toks[pos], seq, seq.num_preemptions)
                self.max_pos = max(self.max_pos, pos)
            if not samp:
                out.append(None)
                continue
            ctx = []
            for pos in range(start + n):
                tok, writer, gen = self.cache[seq.block_table[pos // P] * P + pos % P]
                assert writer is seq and gen == seq.num_preemptions, (seq, pos)
                ctx.append(tok)
            assert ctx == toks
            tok = script(seq, len(toks) - seq.num_prompt_tokens) if script else fake_next_token(ctx)
            self.sampled.setdefault(id(seq), []).append(tok)
            out.append(tok)
        return out


def step_sync(sched, dev, batch):
    """Run ``batch`` on the fake device and postprocess it at once (no asynchronous lag)."""
    out = dev.step(batch)
    sched.postprocess(batch, out)
    dev.postprocessed(batch, out)
    return out


def schedule_checked(sched):
    """``sched.schedule()`` and `check_invariants` on its batch: (batch or None, decode rows)."""
    running_before = list(sched.running)
    batch = sched.schedule()
    return batch, (check_invariants(sched, batch, running_before) if batch else 0)


def check_rows(sched, batch, running_before):
    """The batch's rows: one token budget; decode rows first (their sequences were in
    ``running_before``, ``sched.running`` before the batch was scheduled), in admission order, one
    token each; then prefill rows, only the last one partial. Returns how many rows decode."""
    assert batch.num_seqs <= sched.max_num_seqs
    assert len({id(s) for s in batch.seqs}) == batch.num_seqs
    assert sum(batch.num_new_tokens) <= sched.max_num_batched_tokens  # one budget, all rows
    k = sum(s in running_before for s in batch.seqs)
    assert batch.seqs[:k] == [s for s in running_before if s in batch.seqs]  # first, in order
    assert batch.num_new_tokens[:k] == [1] * k and all(batch.do_sample[:k])
    assert all(
        st + 1 == s.num_computed_tokens == s.num_tokens_with_pending - 1
        for s, st in zip(batch.seqs[:k], batch.start_positions[:k])
    )
    assert all(batch.do_sample[k:-1])  # at most one partial prefill: the last row
    return k


def check_invariants(sched, batch, running_before):
    """`check_rows`, then the pool's invariants (no page shared: no prefix caching here);
    returns how many leading rows decode."""
    k, bm = check_rows(sched, batch, running_before), sched.block_manager
    assert sched.num_running <= sched.max_num_seqs
    for s, st, n in zip(batch.seqs, batch.start_positions, batch.num_new_tokens):
        assert s.status is SequenceStatus.RUNNING
        assert st + n <= sched.max_model_len - 1  # nothing written at a position >= L - 1
        assert len(s.block_table) * sched.page_size >= st + n
    holders = list(sched.running) + ([sched.prefilling] if sched.prefilling else [])
    pages = [p for s in holders for p in s.block_table]
    assert 0 not in pages and len(pages) == len(set(pages))
    assert len(pages) + bm.num_free_pages == bm.num_usable_pages
    assert all(
        not s.block_table and s.num_computed_tokens == 0 and s.status is SequenceStatus.WAITING
        for s in sched.waiting
    )
    return k


class VictimCheck:
    """Checks the preemption policy around each ``schedule()``: victims are the most recently
    admitted page holders, newer than every sequence kept in the batch, and they go to the front
    of the waiting queue, oldest first; a step that preempts admits and prefills nothing."""

    def __init__(self):
        self.admitted_at, self.clock, self.num_victims = {}, 0, 0
        self.fresh_admissions = []  # first admissions, in order (FIFO: equals add order)

    def before(self, sched):
        holders = list(sched.running) + ([sched.prefilling] if sched.prefilling else [])
        self.snapshot = [(s, s.num_preemptions) for s in holders]

    def after(self, sched, batch, num_decode):
        victims = [s for s, n in self.snapshot if s.num_preemptions > n]
        if victims:
            assert num_decode == batch.num_seqs  # decode rows only
            self.num_victims += len(victims)
            kept = [self.admitted_at[id(s)] for s in batch.seqs]
            assert min(self.admitted_at[id(v)] for v in victims) > max(kept, default=-1)
            order = sorted(victims, key=lambda v: self.admitted_at[id(v)])
            assert list(sched.waiting)[: len(victims)] == order
        for s, st in zip(batch.seqs[num_decode:], batch.start_positions[num_decode:]):
            if st == 0:
                self.admitted_at[id(s)] = self.clock
                self.clock += 1
                if s.num_preemptions == 0:
                    self.fresh_admissions.append(s)


class Batches(list):
    """The batches of a `run`; ``num_decode[i]``: how many leading rows of batch i decode."""

    def __init__(self):
        super().__init__()
        self.num_decode = []

    def prefill_rows(self):
        """Per batch with prefill rows: [(seq, num_new_tokens, start, do_sample), ...]."""
        return [
            list(zip(b.seqs, b.num_new_tokens, b.start_positions, b.do_sample))[k:]
            for b, k in zip(self, self.num_decode)
            if k < b.num_seqs
        ]


def run(sched, dev=None, script=None, between=None, max_steps=20000, victims=None, lag=0):
    """Drive schedule -> fake step -> postprocess until done; returns the `Batches`.

    lag=0: each batch is postprocessed before the next is scheduled. lag=1 (asynchronous
    scheduling): batch n is postprocessed after batch n+1 was scheduled and run.
    """
    dev = dev or FakeDevice(sched)
    victims = victims or VictimCheck()
    batches, in_flight = Batches(), []
    for step in range(max_steps):
        more = between(step, sched) if between else False  # more arrivals to come
        if not sched.has_unfinished() and not in_flight:
            if more:
                continue
            break
        victims.before(sched)
        batch, k = schedule_checked(sched)
        if batch is not None:
            victims.after(sched, batch, k)
            in_flight.append((batch, dev.step(batch, script)))
            batches.append(batch)
            batches.num_decode.append(k)
        else:
            assert in_flight, "nothing scheduled and nothing in flight"
        while len(in_flight) > (lag if batch is not None else 0):
            b, out = in_flight.pop(0)
            sched.postprocess(b, out)
            dev.postprocessed(b, out)
    else:
        raise AssertionError("did not finish")
    assert sched.schedule() is None
    assert sched.block_manager.num_free_pages == sched.block_manager.num_usable_pages
    assert sched.num_running == 0 and sched.num_waiting == 0
    return batches


def rows(batch):
    """``batch`` as [(request_id, num_new_tokens, start, do_sample), ...]."""
    return [
        (s.request_id, n, st, smp)
        for s, n, st, smp in zip(
            batch.seqs, batch.num_new_tokens, batch.start_positions, batch.do_sample
        )
    ]


def make(num_pages, page_size, *, max_num_seqs=8, budget=64, L=256, eos=()):
    return Scheduler(
        BlockManager(num_pages, page_size),
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        max_model_len=L,
        page_size=page_size,
        eos_token_ids=eos,
    )


def prompt_of(n, rng=None, salt=0):
    rng = rng or random.Random(n * 7919 + salt)
    return [rng.randrange(VOCAB) for _ in range(n)]


def add(sched, rid, n_prompt, **kw):
    seq = Sequence(
        rid, prompt_of(n_prompt, salt=zlib.crc32(rid.encode()) % 1000), SamplingParams(**kw), 0
    )
    sched.add(seq)
    return seq


def assert_matches_reference(sched, seqs):
    for s in seqs:
        out, reason = reference_generate(
            s.prompt_token_ids, s.params, sched.eos_token_ids, sched.max_model_len
        )
        assert (s.output_token_ids, s.finish_reason) == (out, reason), s
        assert s.is_finished and not s.block_table
        assert s.arrival_time <= s.first_token_time <= s.finish_time


# ---------------------------------------------------------------- admission (CASES.md C1-C3)
def test_c1_length_admission_rule():
    """A prompt of max_model_len tokens or more is rejected; a max_tokens beyond the room left is
    admitted and generates until the context is full, "length" (vLLM's engine)."""
    sched = make(1 + 16, 16, L=64)
    ok = add(sched, "63+1", 63, max_tokens=1)
    for n in (64, 65):
        with pytest.raises(ValueError) as e:
            add(sched, f"{n}+1", n, max_tokens=1)
        assert f"{n} tokens" in str(e.value) and "max_model_len=64" in str(e.value)
    full = add(sched, "60+20", 60, max_tokens=20, ignore_eos=True)
    ok2 = add(sched, "62+2", 62, max_tokens=2, ignore_eos=True)
    dev = FakeDevice(sched)
    run(sched, dev)
    assert_matches_reference(sched, [ok, full, ok2])
    assert ok.finish_reason == "length" and len(ok.output_token_ids) == 1
    assert full.finish_reason == "length" and len(full.output_token_ids) == 4
    assert len(ok2.output_token_ids) == 2
    assert dev.max_pos < 64


def test_c2_empty_prompt_rejected_next_succeeds():
    sched = make(1 + 8, 16)
    with pytest.raises(ValueError, match=r"^prompt has 0 tokens; at least 1 required$"):
        sched.add(Sequence("empty", [], SamplingParams(), 0))
    assert not sched.has_unfinished()
    s = add(sched, "next", 5, max_tokens=4)
    run(sched)
    assert_matches_reference(sched, [s])


def test_c3_worst_case_pages_checked_at_admission():
    sched = make(1 + 8, 16, L=512)
    with pytest.raises(ValueError) as e:
        add(sched, "big", 200, max_tokens=8)
    msg = str(e.value)
    assert "200 tokens" in msg and "needs 13 KV pages" in msg and "8 usable pages" in msg
    small = add(sched, "small", 10, max_tokens=8)
    run(sched)
    assert_matches_reference(sched, [small])
    assert sched.block_manager.num_free_pages == 8


def test_add_rejects_duplicate_and_non_fresh():
    sched = make(1 + 8, 4)
    add(sched, "a", 3)
    with pytest.raises(ValueError, match="request_id='a'"):
        add(sched, "a", 3)
    s = Sequence("b", [1, 2], SamplingParams(), 0, output_token_ids=[5])
    with pytest.raises(ValueError, match="fresh"):
        sched.add(s)
    assert sched.num_waiting == 1


def test_constructor_validation():
    with pytest.raises(ValueError, match="page_size=8 is invalid"):
        Scheduler(
            BlockManager(4, 16),
            max_num_seqs=1,
            max_num_batched_tokens=1,
            max_model_len=8,
            page_size=8,
        )
    with pytest.raises(ValueError, match="max_num_seqs=0 is invalid"):
        Scheduler(
            BlockManager(4, 16),
            max_num_seqs=0,
            max_num_batched_tokens=1,
            max_model_len=8,
            page_size=16,
        )


def test_postprocess_and_schedule_misuse():
    sched = make(1 + 16, 4, budget=4)
    add(sched, "a", 10, max_tokens=2)
    batch = sched.schedule()
    assert batch.do_sample == [False] and batch.seqs[0].num_computed_tokens == 4
    second = sched.schedule()  # one batch may be in flight: the next chunk
    assert second.start_positions == [4] and len(sched._in_flight) == 2
    with pytest.raises(RuntimeError, match="not postprocessed"):
        sched.schedule()  # but not two
    with pytest.raises(ValueError, match="expected None"):
        sched.postprocess(batch, [5])
    with pytest.raises(ValueError, match="1 sequences"):
        sched.postprocess(batch, [None, None])
    with pytest.raises(RuntimeError, match="not the one"):
        sched.postprocess(second, [None])  # out of order
    with pytest.raises(RuntimeError, match="not the one"):
        sched.postprocess(ScheduledBatch(batch.seqs, [4]), [None])
    assert batch.seqs[0].num_computed_tokens == 8  # nothing changed by the failures
    sched.postprocess(batch, [None])
    sched.postprocess(second, [None])
    assert len(sched._in_flight) == 0


# ---------------------------------------------------------------- design rule
def test_host_modules_import_no_jax():
    root = pathlib.Path(__file__).resolve().parents[2] / "jaxinfer"
    for rel in [
        "sampling_params.py",
        "engine/sequence.py",
        "engine/block_manager.py",
        "engine/scheduler.py",
    ]:
        tree = ast.parse((root / rel).read_text())
        for node in ast.walk(tree):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            for name in names:
                assert name.split(".")[0] not in ("jax", "jaxlib", "flax", "numpy"), (rel, name)
