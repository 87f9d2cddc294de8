"""One server for tests/serve: the tiny random model and its character-level tokenizer
(tests/conftest.py: text prompts, chat template, stop strings and logprob token texts work) in an
engine-core process (`tiny_model.tiny_serve_llm`) behind `jaxinfer.serve.app.create_app`, uvicorn
on a free loopback port in a thread of this process, an API key set. Its step shapes are fixed
(one batch bucket of 32, one token bucket of 256, one page of 256 tokens per sequence): prefill
and decode, greedy or sampled, with or without log-probabilities, are compiled up front; a test
that makes it compile another fails (`SERVER_COMPILES`, checked by ``wait_idle``). Random
weights: tests compare the server's outputs with `LLM.generate` on an engine of the same model
and configuration in this process (``server.llm``), not with expected text."""

import asyncio
import functools
import os
import signal
import socket
import threading
import time
from types import SimpleNamespace

import pytest

MODEL, KEY = "smol", "test-key"
PROMPTS = [
    "The capital of France is",
    "def add(a, b):",
    "One, two, three,",
    "Water boils at",
    "The quick brown fox",
    "In 1492, Columbus",
    "My favourite colour is",
    "import numpy as np\n",
]
SERVE_ENGINE = dict(
    max_model_len=256,
    max_num_seqs=32,
    page_size=256,
    num_pages=40,
    max_num_batched_tokens=256,
    kernels="batch_buckets=32,token_buckets=256",
)
# a decode and a ragged forward; the sampler at 32 rows at each level (greedy, sampled, and
# full: the min_tokens bias on a prompt's first chunk, top-k logprobs, the grammar bitmask); the
# prompt scorer (prompt_logprobs, echo) at each of the 5 buckets of scored positions, 16 to 256
SERVER_COMPILES = 10


def _interrupt(signum, frame):
    """SIGTERM while the server is up: KeyboardInterrupt (pytest tears down and stops; asyncio
    re-raises it, where ``gather(return_exceptions=True)`` would keep an Exception), and a hard
    exit if stopping takes over 30 s."""
    timer = threading.Timer(30, os._exit, (128 + signum,))
    timer.daemon = True
    timer.start()
    raise KeyboardInterrupt(f"signal {signum}")


@pytest.fixture(scope="package")
def server(tiny_llm):
    llm = tiny_llm(max_compiles=SERVER_COMPILES, **SERVE_ENGINE)
    yield from serve(llm, SERVE_ENGINE)


def serve(llm, engine_args: dict, **app_args):
    """A server (uvicorn in a thread) of `create_app` over an engine core of the tiny text model
    with ``engine_args`` (`tiny_model.tiny_serve_llm`) and ``app_args``; yields its namespace
    (``llm``: the in-process engine of the same configuration), then stops it."""
    import uvicorn
    from tiny_model import tiny_serve_llm

    from jaxinfer.serve.app import create_app
    from jaxinfer.serve.client import EngineCoreClient

    client = EngineCoreClient(
        functools.partial(tiny_serve_llm, engine_args, " ".join(PROMPTS), SERVER_COMPILES)
    )
    app = create_app(client, served_model_name=MODEL, api_key=KEY, **app_args)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    while not srv.started:
        assert thread.is_alive(), "uvicorn did not start"
        time.sleep(0.05)
    previous = signal.signal(signal.SIGTERM, _interrupt)  # test_load.py's docstring says why
    yield SimpleNamespace(
        llm=llm, app=app, client=client, port=port, url=f"http://127.0.0.1:{port}/v1"
    )
    signal.signal(signal.SIGTERM, previous)
    srv.should_exit = True
    thread.join(60)
    client.close()


@pytest.fixture(scope="package")
def client(server):
    import openai

    return openai.OpenAI(base_url=server.url, api_key=KEY, max_retries=0)


@pytest.fixture
def wait_idle():
    return _wait_idle


@pytest.fixture
def raw():
    return _raw_request


def _wait_idle(server, timeout: float = 60.0, compiles: int | None = SERVER_COMPILES) -> None:
    """Wait until the engine core holds no request; then every KV page is free (or cached) and it
    compiled no step shape beyond ``compiles`` (None: not checked)."""
    client, deadline = server.client, time.monotonic() + timeout
    while client._open or client.stats["num_running"] or client.stats["num_waiting"]:
        assert time.monotonic() < deadline, "the engine did not go idle"
        time.sleep(0.02)
    assert client.stats["kv_pages_in_use"] == 0
    assert compiles is None or client.stats["num_compiles"] == compiles


async def _raw_request(
    port: int,
    body: bytes,
    *,
    path: str = "/v1/completions",
    method: str = "POST",
    headers: dict | None = None,
) -> tuple[int, bytes]:
    """(status, body) of one HTTP/1.1 request written byte for byte (any body, any header)."""
    r, w = await asyncio.open_connection("127.0.0.1", port)
    head = {
        "Host": "x",
        "Content-Type": "application/json",
        "Authorization": f"Bearer {KEY}",
        "Content-Length": str(len(body)),
        "Connection": "close",
        **(headers or {}),
    }
    # of a body over 1 MiB nothing: the server answers (413) from the declared Content-Length
    # without reading it, and body bytes left unread when it closes make the close a reset, which
    # may discard its answer before this side reads it
    w.write(
        f"{method} {path} HTTP/1.1\r\n".encode()
        + b"".join(f"{k}: {v}\r\n".encode() for k, v in head.items() if v is not None)
        + b"\r\n"
        + (body if len(body) <= 1 << 20 else b"")
    )
    await w.drain()
    data = await r.read()
    w.close()
    status = int(data.split(b" ", 2)[1])
    payload = data.split(b"\r\n\r\n", 1)[1]
    if b"transfer-encoding: chunked" in data.split(b"\r\n\r\n", 1)[0].lower():
        out, rest = b"", payload
        while rest:
            size, rest = rest.split(b"\r\n", 1)
            if not int(size, 16):
                break
            out, rest = out + rest[: int(size, 16)], rest[int(size, 16) + 2 :]
        payload = out
    return status, payload
