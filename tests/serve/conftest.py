"""One server for tests/serve: the embedded SmolLM2 (float32) behind `jaxinfer.serve.create_app`,
uvicorn on a free loopback port in a thread, an API key set. Four step shapes (one batch bucket,
one page of 64 tokens per sequence; prefill and decode, greedy or not), compiled in parallel up
front, keep the CPU compile time down."""

import asyncio
import socket
import threading
import time
from types import SimpleNamespace

import pytest

MODEL, KEY = "smol", "test-key"
PROMPTS = ["The capital of France is", "def add(a, b):", "One, two, three,",
           "Water boils at", "The quick brown fox", "In 1492, Columbus",
           "My favourite colour is", "import numpy as np\n"]


@pytest.fixture(scope="package")
def server(smollm_path):
    import uvicorn

    from jaxinfer import LLM
    from jaxinfer.serve import create_app

    from jaxinfer import SamplingParams

    llm = LLM(smollm_path, max_model_len=64, max_num_seqs=32, page_size=64, num_pages=40,
              max_num_batched_tokens=256, dtype="float32",
              kernels="batch_buckets=32,token_buckets=256")
    ids = llm.encode(PROMPTS[0])
    llm.engine.precompile([k for t in (0.0, 1.0) for k in llm.engine.plan_shapes(
        [(ids, SamplingParams(temperature=t, max_tokens=2))])])
    app = create_app(llm, served_model_name=MODEL, api_key=KEY)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    while not srv.started:
        assert thread.is_alive(), "uvicorn did not start"
        time.sleep(0.05)
    yield SimpleNamespace(llm=llm, app=app, port=port, url=f"http://127.0.0.1:{port}/v1")
    srv.should_exit = True
    thread.join(60)


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


def _wait_idle(server, timeout: float = 60.0) -> None:
    """Wait until the engine thread holds no request; then every KV page is free (or cached)."""
    runner, bm = server.app.state.runner, server.llm.engine.block_manager
    deadline = time.monotonic() + timeout
    while not (runner.idle.is_set() and runner._cmds.empty()):
        assert time.monotonic() < deadline, "the engine did not go idle"
        time.sleep(0.02)
    assert bm.num_free_pages == bm.num_usable_pages
    if hasattr(bm, "check"):
        assert bm.check()["used"] == 0


async def _raw_request(port: int, body: bytes, *, path: str = "/v1/completions",
                      method: str = "POST", headers: dict | None = None) -> tuple[int, bytes]:
    """(status, body) of one HTTP/1.1 request written byte for byte (any body, any header)."""
    r, w = await asyncio.open_connection("127.0.0.1", port)
    head = {"Host": "x", "Content-Type": "application/json", "Authorization": f"Bearer {KEY}",
            "Content-Length": str(len(body)), "Connection": "close", **(headers or {})}
    # of a body over 1 MiB only the first 64 KiB: the server answers (413) without reading it
    w.write(f"{method} {path} HTTP/1.1\r\n".encode() + b"".join(
        f"{k}: {v}\r\n".encode() for k, v in head.items() if v is not None) + b"\r\n"
        + (body if len(body) <= 1 << 20 else body[:1 << 16]))
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
            out, rest = out + rest[:int(size, 16)], rest[int(size, 16) + 2:]
        payload = out
    return status, payload
