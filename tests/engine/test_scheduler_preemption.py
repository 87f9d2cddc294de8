"""Scheduler: preemption by recompute, stop conditions, finish and abort, and randomized sweeps
against the reference (the harness is `tests/engine/test_scheduler.py`'s)."""

import random
from collections import Counter

import pytest

from jaxinfer.engine.sequence import Sequence
from jaxinfer.sampling_params import SamplingParams
from tests.engine.test_scheduler import (
    VOCAB,
    FakeDevice,
    VictimCheck,
    add,
    assert_matches_reference,
    make,
    prompt_of,
    run,
    schedule_checked,
    step_sync,
)


# ---------------------------------------------------------------- preemption
def test_preemption_recomputes_prompt_and_outputs():
    P = 4
    sched = make(1 + 4, P, budget=64, max_num_seqs=2)
    a = add(sched, "a", 4, max_tokens=8, ignore_eos=True)
    b = add(sched, "b", 4, max_tokens=8, ignore_eos=True)
    c = add(sched, "c", 1, max_tokens=2, ignore_eos=True)  # waits (max_num_seqs=2); would fit
    victims = VictimCheck()
    batches = run(sched, victims=victims)
    recompute = [
        (s, st, n) for r in batches.prefill_rows() for s, n, st, _ in r if s is b and st == 0
    ]
    # b (admitted last) was preempted when a needed its third page; a never was
    assert a.num_preemptions == 0 and b.num_preemptions >= 1 and victims.num_victims >= 1
    assert len(recompute) == 1 + b.num_preemptions
    # the recompute covers prompt + the outputs b had (> prompt); sampled only at its end
    assert all(n > b.num_prompt_tokens for _, _, n in recompute[1:])
    # the preempted b went back to the FRONT: re-admitted before c is first admitted
    admitted = [s.request_id for r in batches.prefill_rows() for s, _, st, _ in r if st == 0]
    assert admitted == ["a", "b"] + ["b"] * b.num_preemptions + ["c"]
    assert_matches_reference(sched, [a, b, c])


def test_victim_is_the_newest_admitted():
    P = 4
    sched = make(1 + 6, P, budget=64)
    a, b, c = (add(sched, r, 4, max_tokens=8, ignore_eos=True) for r in "abc")
    victims = VictimCheck()
    run(sched, victims=victims)
    assert victims.num_victims >= 1 and a.num_preemptions == 0 and b.num_preemptions == 0
    assert c.num_preemptions >= 1
    assert_matches_reference(sched, [a, b, c])


def test_partially_prefilled_sequence_is_the_first_victim():
    P = 4
    sched = make(1 + 5, P, budget=8)
    a = add(sched, "a", 4, max_tokens=12, ignore_eos=True)
    c = add(sched, "c", 17, max_tokens=1, ignore_eos=True)
    dev, partial_victims = FakeDevice(sched), 0
    while sched.has_unfinished():
        before = (sched.prefilling, sched.prefilling.num_preemptions if sched.prefilling else 0)
        batch, num_decode = schedule_checked(sched)
        if before[0] is not None and before[0].num_preemptions > before[1]:
            assert num_decode == batch.num_seqs and before[0].num_output_tokens == 0
            assert before[0] not in batch.seqs and sched.waiting[0] is before[0]
            partial_victims += 1
        step_sync(sched, dev, batch)
    assert partial_victims >= 1 and a.num_preemptions == 0
    assert_matches_reference(sched, [a, c])
    assert sched.block_manager.num_free_pages == 5


@pytest.mark.parametrize("lag", [0, 1])
def test_many_sequences_small_pool_all_finish(lag):
    rng = random.Random(7)
    P = 4
    sched = make(1 + 12, P, max_num_seqs=16, budget=16, L=48)
    seqs = []
    for i in range(24):
        n = rng.randrange(1, 20)
        seqs.append(
            add(
                sched,
                f"r{i}",
                n,
                max_tokens=rng.randrange(1, 48 - n + 1) if (n + 12) > 48 else rng.randrange(1, 13),
                ignore_eos=True,
            )
        )
    batches = run(sched, lag=lag)
    assert sum(s.num_preemptions for s in seqs) > 0
    assert any(0 < k < x.num_seqs for x, k in zip(batches, batches.num_decode))  # mixed steps
    assert_matches_reference(sched, seqs)
    assert all(len(s.output_token_ids) == s.params.max_tokens for s in seqs)


# ---------------------------------------------------------------- stop conditions
def scripted(tokens_by_rid):
    """Output token i of a request is ``tokens_by_rid[rid][i]`` (0 past the list: with lag=1 a
    request that stops on a token is possibly run once more and that token is dropped)."""

    def script(seq, i):
        toks = tokens_by_rid[seq.request_id]
        return toks[i] if i < len(toks) else 0

    return script


@pytest.mark.parametrize(
    "kw,script,want_out,want_reason",
    [
        # stop token is checked before max_tokens
        (dict(max_tokens=3, stop_token_ids=[7]), [1, 3, 7, 4], [1, 3, 7], "stop"),
        (dict(max_tokens=3, stop_token_ids=[7]), [1, 3, 4, 7], [1, 3, 4], "length"),
        # EOS (engine's set {2, 99}) stops unless ignore_eos
        (dict(max_tokens=5), [5, 99, 6, 6, 6], [5, 99], "stop"),
        (dict(max_tokens=5), [5, 2, 6, 6, 6], [5, 2], "stop"),
        (dict(max_tokens=5, ignore_eos=True), [5, 99, 6, 2, 6, 6], [5, 99, 6, 2, 6], "length"),
        # stop_token_ids still apply with ignore_eos
        (dict(max_tokens=5, ignore_eos=True, stop_token_ids=[6]), [99, 6, 1], [99, 6], "stop"),
        # EOS on the first (prefill-sampled) token
        (dict(max_tokens=5), [99], [99], "stop"),
        (dict(max_tokens=1), [3], [3], "length"),
    ],
)
@pytest.mark.parametrize("lag", [0, 1])
def test_stop_conditions_and_order(kw, script, want_out, want_reason, lag):
    sched = make(1 + 8, 4, eos=(2, 99))
    s = add(sched, "r", 6, **kw)
    run(sched, script=scripted({"r": script}), lag=lag)
    assert (s.output_token_ids, s.finish_reason) == (want_out, want_reason)


def test_finish_from_outside_and_abort():
    sched = make(1 + 16, 4, max_num_seqs=2, budget=64)
    a = add(sched, "a", 5, max_tokens=10, ignore_eos=True)
    b = add(sched, "b", 6, max_tokens=10, ignore_eos=True)
    c = add(sched, "c", 7, max_tokens=10, ignore_eos=True)  # waits: max_num_seqs=2
    d = add(sched, "d", 3, max_tokens=10, ignore_eos=True)
    dev = FakeDevice(sched)
    batch = sched.schedule()
    assert [s.request_id for s in batch.seqs] == ["a", "b"]
    sampled = dev.step(batch)
    # while the step runs: abort one in flight, and one still waiting
    assert sched.abort("b") is b and sched.abort("c") is c and sched.abort("zzz") is None
    assert b.finish_reason == "abort" and not b.block_table and b.is_finished
    assert c.finish_reason == "abort" and c.finish_time is not None
    fin = sched.postprocess(batch, sampled)
    dev.postprocessed(batch, sampled)
    assert fin == [] and b.output_token_ids == [] and len(a.output_token_ids) == 1
    assert sched.abort("b") is None
    # stop string matched by the engine: finish() from outside
    batch = sched.schedule()
    step_sync(sched, dev, batch)
    assert sched.finish(a, "stop") is True and a.finish_reason == "stop" and not a.block_table
    assert sched.finish(a, "length") is False and a.finish_reason == "stop"
    with pytest.raises(ValueError, match="reason='bogus'"):
        sched.finish(d, "bogus")
    while sched.has_unfinished():
        batch, _ = schedule_checked(sched)
        step_sync(sched, dev, batch)
    assert_matches_reference(sched, [d])
    assert sched.block_manager.num_free_pages == 16


def test_abort_partially_prefilled_and_lookup():
    sched = make(1 + 32, 4, budget=8)
    long = add(sched, "long", 30, max_tokens=2, ignore_eos=True)
    short = add(sched, "short", 3, max_tokens=3, ignore_eos=True)
    dev = FakeDevice(sched)
    batch = sched.schedule()
    step_sync(sched, dev, batch)
    assert sched.prefilling is long and sched.get("long") is long and long.block_table
    assert sched.abort("long") is long and sched.prefilling is None and not long.block_table
    assert sched.get("long") is None and long.finish_reason == "abort"
    assert sched.block_manager.num_free_pages == 32
    with pytest.raises(ValueError, match="not scheduled here"):
        sched.finish(Sequence("short", [1], SamplingParams(), 0), "stop")
    run(sched, dev)
    assert_matches_reference(sched, [short])
    assert short.last_token_id == short.output_token_ids[-1]


# ---------------------------------------------------------------- randomized sweep
@pytest.mark.parametrize("lag", [0, 1])
@pytest.mark.parametrize("seed", range(12))
def test_random_configs_match_reference(seed, lag):
    rng = random.Random(seed)
    P = rng.choice([1, 2, 4, 8])
    L = rng.choice([16, 24, 40, 64])
    num_pages = 1 + max(1, rng.randrange(L // P // 2 + 1, 3 * L // P + 2))
    sched = make(
        num_pages,
        P,
        max_num_seqs=rng.choice([1, 2, 3, 8, 32]),
        budget=rng.choice([1, 3, 8, 17, 64]),
        L=L,
        eos=rng.sample(range(VOCAB), rng.choice([0, 3, 30])),
    )
    usable = num_pages - 1
    accepted, pending, rejected = [], [], [0]
    for i in range(30):
        if rng.random() < 0.15:  # often inadmissible
            n, m = rng.randrange(0, L + 2), rng.randrange(1, L)
        else:
            n, m = rng.randrange(1, L // 2), rng.randrange(1, L // 2)
        kw = dict(
            max_tokens=m,
            ignore_eos=rng.random() < 0.5,
            stop_token_ids=rng.sample(range(VOCAB), rng.choice([0, 0, 20])),
        )
        pending.append(
            (rng.randrange(0, 60), Sequence(f"r{i}", prompt_of(n, rng), SamplingParams(**kw), i))
        )

    def arrivals(step, s):  # continuous batching: requests arrive while others run
        for _, seq in [x for x in pending if x[0] == step]:
            n, m = seq.num_prompt_tokens, seq.params.max_tokens
            most = min(n + m, L)  # a max_tokens beyond the room left ends with "length"
            should_reject = n == 0 or n >= L or -(-most // P) > usable
            if should_reject:
                with pytest.raises(ValueError):
                    s.add(seq)
                rejected[0] += 1
            else:
                s.add(seq)
                accepted.append(seq)
        return any(t > step for t, _ in pending)

    victims = VictimCheck()
    run(sched, between=arrivals, max_steps=5000, victims=victims, lag=lag)
    assert victims.fresh_admissions == accepted
    assert len(accepted) == len(pending) - rejected[0] and len(accepted) >= 10
    assert_matches_reference(sched, accepted)


@pytest.mark.parametrize("lag", [0, 1])
def test_random_sweep_exercises_preemption(lag):
    """The sweep above is only meaningful if it actually preempts; count it over fixed seeds."""
    total = Counter()
    for seed in range(40):
        rng = random.Random(1000 + seed)
        P = rng.choice([2, 4])
        sched = make(1 + rng.randrange(4, 10), P, max_num_seqs=8, budget=rng.choice([4, 16]), L=32)
        seqs = []
        for i in range(12):
            n = rng.randrange(1, 12)
            m = rng.randrange(1, 32 - n)
            if -(-(n + m) // P) <= sched.block_manager.num_usable_pages:
                seqs.append(add(sched, f"r{i}", n, max_tokens=m, ignore_eos=True))
        victims = VictimCheck()
        run(sched, victims=victims, lag=lag)
        assert victims.fresh_admissions == seqs
        assert_matches_reference(sched, seqs)
        total["preemptions"] += sum(s.num_preemptions for s in seqs)
        total["checked"] += victims.num_victims
    assert total["preemptions"] > 10 and total["checked"] == total["preemptions"]
