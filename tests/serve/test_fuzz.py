"""Schemathesis fuzzes the server through its own OpenAPI schema (``/openapi.json``; issue 28 item
5): on every operation, bodies that fit the schema and bodies that do not (schemathesis's
positive and negative modes) get no 5xx, every 4xx is OpenAI's error JSON, and afterwards the
server still answers. Every accepted request costs engine steps (a second or so on a CPU), so
each generates at most one token; in CI a fixed few examples per operation run, and the fields
that pick another compiled step shape (penalties, logit_bias, min_tokens, logprobs) are left
out so the server compiles nothing new. ``JAXINFER_FUZZ_EXAMPLES=N`` runs N examples per
operation with those fields kept and schemathesis's coverage phase on, and prints the count of
each (operation, status) (BENCHMARKS.md; an operation then takes over the 5 minutes after which
pytest's faulthandler_timeout prints every thread's stack, hence the -o):

    JAXINFER_FUZZ_EXAMPLES=10000 python -m pytest tests/serve/test_fuzz.py -q -s \
        -o faulthandler_timeout=0
"""

import asyncio
import collections
import json
import os
from types import SimpleNamespace

import pytest

schemathesis = pytest.importorskip("schemathesis")

from hypothesis import HealthCheck, settings  # noqa: E402

from jaxinfer.serve.app import create_app  # noqa: E402

from .conftest import KEY, MODEL, SERVER_COMPILES  # noqa: E402

LONG = int(os.environ.get("JAXINFER_FUZZ_EXAMPLES", "0"))
SEEN = collections.Counter()  # (method, path, status) -> cases
SHAPE_FIELDS = (
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logit_bias",
    "min_tokens",
    "logprobs",
    "top_logprobs",
)
schema = schemathesis.openapi.from_dict(
    create_app(SimpleNamespace()).openapi(),  # the schema alone: no engine behind this app
    config=schemathesis.config.SchemathesisConfig.from_dict(
        {"phases": {"coverage": {"enabled": bool(LONG)}}, "max-stream-events": 100_000}
    ),
)


@schema.hook
def map_body(context, body):
    """At most one generated token per accepted request; in CI no new step shape."""
    if not isinstance(body, dict):
        return body
    for k in SHAPE_FIELDS if not LONG else ():
        body.pop(k, None)
    if "max_tokens" not in body and "max_completion_tokens" not in body:
        body["max_tokens"] = 1
    for k in ("max_tokens", "max_completion_tokens"):
        try:  # also what pydantic coerces to a number: "99", 99.0
            body[k] = 1 if float(body[k]) > 1 else body[k]
        except (KeyError, TypeError, ValueError, OverflowError):
            pass
    return body


def _check(response) -> None:
    """No 5xx; a 4xx is exactly OpenAI's error JSON; a 200 of a POST is a completion, or a stream
    of completion chunks ending in [DONE] without an error event."""
    assert response.status_code < 500, response.text
    if response.status_code >= 400:
        body = json.loads(response.text)
        assert list(body) == ["error"], body
        err = body["error"]
        assert set(err) == {"message", "type", "param", "code"}, err
        assert isinstance(err["message"], str) and err["message"] and isinstance(err["type"], str)
        assert all(err[k] is None or isinstance(err[k], str) for k in ("param", "code")), err
    elif response.request.method == "POST":
        if response.headers["content-type"][0].startswith("text/event-stream"):
            assert not response.stream_cut_short
            events = [e.removeprefix("data: ") for e in response.text.split("\n\n") if e]
            assert events[-1] == "[DONE]", events
            assert all("choices" in json.loads(e) for e in events[:-1]), events
        else:
            assert json.loads(response.text)["choices"], response.text


@schema.parametrize()
@settings(
    max_examples=LONG or 8,
    deadline=None,
    derandomize=not LONG,
    database=None,
    suppress_health_check=list(HealthCheck),
)
def test_fuzz(case, server):
    """Schemathesis's cases on the running server (`_check`)."""
    case.headers = {**(case.headers or {}), "Authorization": f"Bearer {KEY}"}
    response = case.call(base_url=f"http://127.0.0.1:{server.port}", timeout=120)
    SEEN[case.method, case.path, response.status_code] += 1
    if LONG and sum(SEEN.values()) % 1000 == 0:
        print(f"{sum(SEEN.values())} cases: {dict(SEEN)}", flush=True)
    _check(response)


def test_server_answers_after_the_fuzz(server, client, raw, wait_idle):
    assert asyncio.run(raw(server.port, b"", path="/health", method="GET"))[0] == 200
    out = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=2)
    assert out.choices[0].finish_reason in ("length", "stop")
    wait_idle(server, compiles=None if LONG else SERVER_COMPILES)
    print(
        f"fuzz: {sum(SEEN.values())} cases: {dict(SEEN)}; compiles: "
        f"{server.client.stats['num_compiles']:.0f}"
    )
