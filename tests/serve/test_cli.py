"""``python -m jaxinfer.serve`` as a process, on the tiny random model's Orbax directory
(``tiny_checkpoint``, tests/conftest.py): it loads back with its tokenizer; bad options
exit 2 with one line; SIGTERM while a stream runs ends that stream (finished or aborted), then
the process exits 0 without a traceback and leaves no engine-core process (nor when SIGTERM
comes while it starts); a killed engine core ends the open requests with errors and the process
with code 1."""

import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest

from .conftest import KEY


def test_bad_option_is_one_line_exit_2():
    r = subprocess.run(
        [sys.executable, "-m", "jaxinfer.serve", "--page-size", "3"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 2, r.stderr
    assert r.stderr.startswith("error:") and "page_size" in r.stderr
    assert "Traceback" not in r.stderr


def test_tiny_checkpoint_loads_back(tiny_checkpoint, tiny_text_params, tiny_tokenizer):
    """`LLM(path)` reads back the weights, the tiny tokenizer (vocabulary, special tokens, chat
    template) and its EOS."""
    import jax
    import numpy as np

    from jaxinfer import LLM

    llm = LLM(
        tiny_checkpoint,
        max_model_len=64,
        page_size=64,
        num_pages=2,
        max_num_seqs=1,
        dtype="float32",
    )
    tok, text = llm.tokenizer, "Hello, wörld! <|im_start|>user\n"
    assert tok.encode(text) == tiny_tokenizer.encode(text) and len(tok) == len(tiny_tokenizer)
    assert tok.chat_template == tiny_tokenizer.chat_template
    assert tiny_tokenizer.eos_token_id in llm.engine.eos_token_ids
    for a, b in zip(
        jax.tree_util.tree_leaves(llm.engine.runner.params),
        jax.tree_util.tree_leaves(tiny_text_params),
    ):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _start(
    checkpoint, ready: bool = True, max_model_len: int = 128
) -> tuple[subprocess.Popen, int, int]:
    """(the API process, its port, the engine core's pid) of ``python -m jaxinfer.serve`` on the
    tiny checkpoint (one sequence at a time, pages of 128 tokens), once /health answers
    (``ready=False``: once the core's process exists)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "jaxinfer.serve",
            "--model",
            checkpoint,
            "--port",
            str(port),
            "--api-key",
            KEY,
            "--served-model-name",
            "m",
            "--max-model-len",
            str(max_model_len),
            "--page-size",
            "128",
            "--num-pages",
            str(max_model_len // 128 + 3),
            "--max-num-seqs",
            "1",
            "--dtype",
            "float32",
            "--kernels",
            "batch_buckets=1,token_buckets=64",
            "--max-num-batched-tokens",
            "64",
            "--shutdown-timeout",
            "0.5",
            "--precompile",
        ],  # a GPU's default: the start-up precompile runs
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=dict(os.environ, HF_HUB_OFFLINE="1"),
    )
    deadline = time.monotonic() + 600
    while not (cores := _cores(proc)) or ready and _health(port) != 200:
        assert proc.poll() is None, proc.communicate()[1][-2000:]
        assert time.monotonic() < deadline
        time.sleep(0.5)
    assert len(cores) == 1, cores
    return proc, port, cores[0]


def _cores(proc) -> list[int]:
    """The pids of ``proc``'s children started by multiprocessing's spawn (the engine core)."""
    with open(f"/proc/{proc.pid}/task/{proc.pid}/children") as f:
        kids = [int(k) for k in f.read().split()]
    return [k for k in kids if b"spawn_main" in open(f"/proc/{k}/cmdline", "rb").read()]


def _health(port: int) -> int | None:
    """/health's status; None: no answer."""
    try:
        return urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return None


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"  # a zombie: exited
    except FileNotFoundError:
        return True


def _stream_in_thread(port: int, max_tokens: int, **kw):
    """(thread, chunks, errors) of a greedy completion read on a thread, streamed unless
    ``stream=False``."""
    import openai

    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=KEY, max_retries=0)
    chunks, errors = [], []

    def read():
        try:
            out = client.completions.create(
                model="m",
                prompt="Once upon a time",
                temperature=0,
                max_tokens=max_tokens,
                extra_body={"ignore_eos": True},
                **{"stream": True, **kw},
            )
            chunks.extend(out if kw.get("stream", True) else [out])
        except Exception as e:  # an error event in the stream, or an error status
            errors.append(e)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    return reader, chunks, errors


def _first_chunk(chunks: list, errors: list) -> None:
    deadline = time.monotonic() + 120
    while not chunks and not errors:
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_sigterm_ends_streams_and_exits_cleanly(tiny_checkpoint):
    proc, port, core = _start(tiny_checkpoint)
    try:
        with open(f"/proc/{proc.pid}/maps") as f:
            assert "jaxlib" not in f.read()  # JAX lives in the engine core only
        reader, chunks, errors = _stream_in_thread(port, 60)
        _first_chunk(chunks, errors)
        proc.send_signal(signal.SIGTERM)
        reader.join(120)
        assert not reader.is_alive()
        assert chunks[-1].choices[0].finish_reason in ("length", "abort")
        assert proc.wait(120) == 0
        err = proc.stderr.read()
        assert "Traceback" not in err, err[-3000:]
        assert "jaxinfer-serve: compiled or loaded" in err and "ready in" in err  # not silent
        assert _gone(core)  # no process left behind
    finally:
        if proc.poll() is None:
            proc.kill()


def test_sigterm_while_starting_stops_the_core(tiny_checkpoint):
    """SIGTERM before /health answers (the core still loading or compiling): the process exits
    130 and its engine core does not outlive it (vLLM's server shuts its engine core down)."""
    proc, _, core = _start(tiny_checkpoint, ready=False)
    try:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 130
        deadline = time.monotonic() + 10
        while not _gone(core):
            assert time.monotonic() < deadline, "the engine core outlived the server"
            time.sleep(0.1)
    finally:
        if proc.poll() is None:
            proc.kill()
        if not _gone(core):
            os.kill(core, signal.SIGKILL)


def test_engine_core_killed_mid_stream(tiny_checkpoint):
    """kill -9 of the engine core: the open stream and a queued request end within seconds (an
    error event, a 503), /health stops answering 200, the API process exits 1."""
    import openai

    # a stream of 1,000 tokens: still open when the kill comes, however the API process and the
    # core are scheduled (100 could all be computed before the first chunk was read)
    proc, port, core = _start(tiny_checkpoint, max_model_len=1024)
    try:
        reader, chunks, errors = _stream_in_thread(port, 1000)
        time.sleep(0.2)  # first in the queue
        queued, _, queued_errors = _stream_in_thread(port, 8, stream=False)
        _first_chunk(chunks, errors)
        t = time.monotonic()
        os.kill(core, signal.SIGKILL)
        for thread in (reader, queued):
            thread.join(20)
            assert not thread.is_alive()
        assert time.monotonic() - t < 20
        assert errors and "engine core process died" in str(errors[0]), (errors, chunks[-1:])
        assert isinstance(queued_errors[0], openai.InternalServerError), queued_errors
        assert _health(port) != 200
        assert proc.wait(30) == 1
        assert "error: the engine core process died" in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()


def test_server_compiles_in_the_step_on_a_cpu(tiny_checkpoint):
    """The server's default: the start-up precompile of the planned set on a GPU only; on a
    CPU the whole set takes minutes on few cores, and a step compiles its own shape."""
    from jaxinfer.cli_args import make_llm
    from jaxinfer.serve.__main__ import build_parser

    args = build_parser().parse_args(
        [
            "--model",
            tiny_checkpoint,
            "--max-model-len",
            "64",
            "--num-pages",
            "8",
            "--max-num-seqs",
            "1",
        ]
    )
    assert args.precompile is None
    llm = make_llm(args)
    assert llm.engine.resolved.engine.precompile is False
    assert llm.engine.stats().num_compiles == 0
    args = build_parser().parse_args(["--precompile"])
    assert args.precompile is True


@pytest.mark.parametrize("port", ["99999", "-1"])
def test_a_port_outside_the_tcp_range_is_one_line(port, capsys):
    from jaxinfer.serve.__main__ import main

    assert main(["--port", port]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: --port {port} is invalid: a TCP port is 0 to 65535"], err
