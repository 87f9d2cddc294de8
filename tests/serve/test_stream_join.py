"""Streamed outputs queued while a reader is slow are joined into one event per request, as vLLM's
``RequestOutputCollector`` merges DELTA outputs (vllm/v1/engine/output_processor.py)."""

import asyncio
import itertools

from jaxinfer.outputs import CompletionOutput, RequestOutput
from jaxinfer.serve.completions import OpenAIServing
from jaxinfer.serve.errors import APIError


class _Client:
    aborted: list = []

    def abort(self, rids) -> None:
        self.aborted += list(rids)


def _delta(rid: str, index: int, ids: list[int], text: str, finished: bool = False):
    out = CompletionOutput(index, text, ids, "length" if finished else None)
    return rid, RequestOutput(rid, None, [1, 2], [out], finished)


def _drain(events: list) -> list:
    async def run():
        sink = asyncio.Queue()
        for ev in events:
            sink.put_nowait(ev)
        serving = OpenAIServing(_Client(), "m", itertools.count())
        return [ev async for ev in serving._events(None, {"a": 0, "b": 1}, sink)]

    return asyncio.run(run())


def test_queued_deltas_are_joined_per_request_and_sample():
    got = _drain(
        [
            _delta("a", 0, [5], "x"),
            _delta("b", 0, [7], "p"),
            _delta("a", 1, [6], "y"),
            _delta("a", 0, [8], "z", True),
            _delta("a", 1, [9], "w", True),
            _delta("b", 0, [3], "q", True),
        ]
    )
    assert [p for p, _ in got] == [0, 1]
    a, b = got[0][1], got[1][1]
    assert a.finished and b.finished
    assert [(c.index, c.token_ids, c.text, c.finish_reason) for c in a.outputs] == [
        (0, [5, 8], "xz", "length"),
        (1, [6, 9], "yw", "length"),
    ]
    assert (b.outputs[0].token_ids, b.outputs[0].text) == ([7, 3], "pq")


def test_an_error_ends_its_request_and_is_not_joined():
    err = APIError("the engine core process died (exit code -9)", 503)
    got = _drain([_delta("a", 0, [5], "x"), ("a", err), _delta("b", 0, [7], "p", True)])
    assert got[0] == (0, err) and got[1][1].outputs[0].text == "p"
