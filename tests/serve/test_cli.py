"""``python -m jaxinfer.serve`` as a process, on the tiny random model's Orbax directory
(``tiny_checkpoint``, tests/conftest.py): it loads back with its tokenizer; bad options
exit 2 with one line; SIGTERM while a stream runs ends that stream (finished or aborted), then
the process exits 0 without a traceback."""

import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request

from .conftest import KEY


def test_bad_option_is_one_line_exit_2():
    r = subprocess.run([sys.executable, "-m", "jaxinfer.serve", "--page-size", "3"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stderr
    assert r.stderr.startswith("error:") and "page_size" in r.stderr
    assert "Traceback" not in r.stderr


def test_tiny_checkpoint_loads_back(tiny_checkpoint, tiny_text_params, tiny_tokenizer):
    """`LLM(path)` reads back the weights, the tiny tokenizer (vocabulary, special tokens, chat
    template) and its EOS."""
    import jax
    import numpy as np

    from jaxinfer import LLM

    llm = LLM(tiny_checkpoint, max_model_len=64, page_size=64, num_pages=2, max_num_seqs=1,
              dtype="float32")
    tok, text = llm.tokenizer, "Hello, wörld! <|im_start|>user\n"
    assert tok.encode(text) == tiny_tokenizer.encode(text) and len(tok) == len(tiny_tokenizer)
    assert tok.chat_template == tiny_tokenizer.chat_template
    assert tiny_tokenizer.eos_token_id in llm.engine.eos_token_ids
    for a, b in zip(jax.tree_util.tree_leaves(llm.engine.runner.params),
                    jax.tree_util.tree_leaves(tiny_text_params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_sigterm_ends_streams_and_exits_cleanly(tiny_checkpoint):
    import openai
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "jaxinfer.serve", "--model", tiny_checkpoint, "--port", str(port),
         "--api-key", KEY, "--served-model-name", "m", "--max-model-len", "128", "--page-size",
         "128", "--num-pages", "4", "--max-num-seqs", "1", "--dtype", "float32", "--kernels",
         "batch_buckets=1,token_buckets=64", "--max-num-batched-tokens", "64",
         "--shutdown-timeout", "0.5"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=dict(os.environ, HF_HUB_OFFLINE="1"))
    try:
        deadline = time.monotonic() + 600
        while True:
            assert proc.poll() is None, proc.communicate()[1][-2000:]
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
                break
            except OSError:
                assert time.monotonic() < deadline
                time.sleep(0.5)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=KEY,
                               max_retries=0)
        chunks = []
        stream = client.completions.create(model="m", prompt="Once upon a time", max_tokens=60,
                                           temperature=0, stream=True,
                                           extra_body={"ignore_eos": True})
        reader = threading.Thread(target=lambda: chunks.extend(stream))
        reader.start()
        while not chunks:
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        reader.join(120)
        assert not reader.is_alive()
        assert chunks[-1].choices[0].finish_reason in ("length", "abort")
        assert proc.wait(120) == 0
        err = proc.stderr.read()
        assert "Traceback" not in err, err[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
