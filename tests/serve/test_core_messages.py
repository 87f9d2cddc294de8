"""Malformed messages between our own processes (issue 44 item 5): the engine core drops what it
cannot decode (a malformed `Abort`, bytes that are no msgpack) and keeps serving."""

import msgspec
import pytest

openai = pytest.importorskip("openai")

from .conftest import MODEL, PROMPTS


def test_core_survives_malformed_messages(server, client, wait_idle):
    before = client.completions.create(
        model=MODEL, prompt=PROMPTS[0], max_tokens=6, temperature=0
    ).choices[0]
    c = server.client
    for raw in (msgspec.msgpack.encode(["Abort", 5]), b"\xc1\xc1", msgspec.msgpack.encode([1])):
        c.loop.call_soon_threadsafe(c._in.send, raw)
    after = client.completions.create(
        model=MODEL, prompt=PROMPTS[0], max_tokens=6, temperature=0
    ).choices[0]
    assert (after.text, after.finish_reason) == (before.text, before.finish_reason)
    assert c.dead is None
    wait_idle(server)
