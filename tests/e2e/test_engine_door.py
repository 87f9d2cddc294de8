"""`LLMEngine`'s door on the tiny model: `step` returns `RequestOutput`s by each request's
``output_kind`` (vLLM's CUMULATIVE, DELTA, FINAL_ONLY), all three agree with `LLM.generate`, and
`abort_request` yields the request's final output at the next step."""

import dataclasses

import pytest

from jaxinfer.sampling_params import RequestOutputKind as Kind
from jaxinfer.sampling_params import SamplingParams

PARAMS = SamplingParams(temperature=0.8, seed=7, n=2, max_tokens=9, logprobs=2, ignore_eos=True)


def drive(eng, ids, kind, **kw) -> list:
    """Every output of one request of ``kind`` until the engine is idle."""
    eng.add_request(ids, dataclasses.replace(PARAMS, output_kind=kind, **kw), request_id="r")
    outs = []
    while eng.has_unfinished():
        outs += eng.step()
    assert {o.request_id for o in outs} == {"r"}
    return outs


def summary(out):
    return [
        (
            c.index,
            c.text,
            c.token_ids,
            c.finish_reason,
            c.stop_reason,
            [sorted(p) for p in c.logprobs],
        )
        for c in out.outputs
    ]


@pytest.fixture(scope="module")
def reference(tiny):
    ids = tiny.get_tokenizer().encode("the door of the engine")
    (out,) = tiny.generate([{"prompt_token_ids": ids}], PARAMS)
    return ids, out


def test_final_only_is_one_finished_output(tiny, reference):
    ids, ref = reference
    (out,) = drive(tiny.engine, ids, Kind.FINAL_ONLY)
    assert out.finished and out.metrics is not None
    assert summary(out) == summary(ref)


def test_deltas_add_up_to_the_final_output(tiny, reference):
    ids, ref = reference
    outs = drive(tiny.engine, ids, Kind.DELTA)
    assert len(outs) > 2 and [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
    assert all(len(c.token_ids) <= 1 for o in outs for c in o.outputs)  # one token per step
    whole = outs[0]
    for o in outs[1:]:
        whole = whole.add(o)
    assert summary(whole) == summary(ref)
    ends = [c.index for o in outs for c in o.outputs if c.finish_reason is not None]
    assert sorted(ends) == [0, 1]  # each sample's finish reason is sent once


def test_cumulative_outputs_grow_to_the_final_output(tiny, reference):
    ids, ref = reference
    outs = drive(tiny.engine, ids, Kind.CUMULATIVE)
    for a, b in zip(outs, outs[1:]):
        for c in a.outputs:
            assert b.outputs[c.index].token_ids[: len(c.token_ids)] == c.token_ids
    assert outs[-1].finished and summary(outs[-1]) == summary(ref)


@pytest.mark.parametrize("kind", [Kind.DELTA, Kind.FINAL_ONLY])
def test_abort_request_gives_a_final_output_next_step(tiny, reference, kind):
    ids, _ = reference
    eng = tiny.engine
    eng.add_request(
        ids, dataclasses.replace(PARAMS, output_kind=kind, max_tokens=40), request_id="a"
    )
    seen = [eng.step() for _ in range(3)]
    eng.abort_request("a")
    eng.abort_request("never-added")  # ignored
    (last,) = eng.step()
    assert last.request_id == "a" and last.finished
    assert [c.finish_reason for c in last.outputs] == ["abort", "abort"]
    while eng.has_unfinished():
        assert eng.step() == []
    if kind is Kind.FINAL_ONLY:
        assert seen == [[], [], []] and 0 < len(last.outputs[0].token_ids) < 40
    assert eng.stats().num_running == eng.stats().num_waiting == 0
