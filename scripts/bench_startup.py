"""Server start-up: seconds from ``python -m jaxinfer.serve`` to ``/health`` answering 200.

Starts the server twice on one checkpoint with one fresh ``--compilation-cache-dir``: the first
start compiles from a cold cache, the second loads from the warm one. Each start includes, when
the server precompiles (``--precompile``/``--no-precompile``, passed on; default: the server's,
on a GPU), the whole planned set (`BucketSpec.planned`: every forward and sampler, 56 programs
at the defaults) compiled before ``/health`` answers, and the number of programs it compiled (the
``jaxinfer:compiled_step_shapes`` metric). A table, one JSON line per start (bench="startup") in
``--out``. ``--offline``: the same two starts of a Python process running ``LLM(model)`` and
then one ``generate`` of one token, timed from the process's launch to that token.

    python scripts/bench_startup.py [--model DIR] [--layers 36] [--max-model-len 2048]
        [--max-num-seqs 256] [--max-num-batched-tokens 8192] [--tiny] [--no-precompile]
        [--offline]

No ``--model``: a random-weight Qwen3-8B-architecture checkpoint (``--layers``) written once to
``--ckpt`` (bench_throughput.py's); ``--tiny``: a 2-layer small one on the CPU.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from scripts.bench_serving import TINY_HF  # noqa: E402
from scripts.bench_throughput import QWEN3_8B_HF  # noqa: E402
from scripts.run_info import git_commit, xla_flags  # noqa: E402


def checkpoint(path: str, hf: dict, layers: int) -> str:
    """A random-weight Qwen3 HF checkpoint of ``hf`` with ``layers`` layers at ``path`` (once), with
    a 1,000-word word-level tokenizer."""
    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):  # a GPU inits in seconds
        model = Qwen3ForCausalLM(Qwen3Config(num_hidden_layers=layers, **hf))
    torch.set_default_dtype(torch.float32)
    model.save_pretrained(path)
    del model
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(1000)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()  # a word-level stand-in: the server needs one
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0", eos_token="w1").save_pretrained(
        path
    )
    return path


def start(cmd: list[str], timeout: float) -> tuple[float, float]:
    """(seconds to /health 200, programs compiled by then); the server is stopped after."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t0 = time.perf_counter()
    child = subprocess.Popen(cmd + ["--port", str(port)], cwd=ROOT, stdout=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        while time.perf_counter() - t0 < timeout:
            if child.poll() is not None:
                raise SystemExit(f"the server exited with {child.returncode}")
            try:
                urllib.request.urlopen(url + "/health", timeout=1)
                ready = time.perf_counter() - t0
                text = urllib.request.urlopen(url + "/metrics", timeout=5).read().decode()
                compiles = next(
                    (
                        float(line.split()[-1])
                        for line in text.splitlines()
                        if line.startswith("jaxinfer:compiled_step_shapes")
                    ),
                    float("nan"),
                )
                return ready, compiles
            except OSError:
                time.sleep(0.2)
        raise SystemExit(f"no /health 200 within {timeout} s")
    finally:
        child.terminate()
        child.wait(60)


OFFLINE = """
import sys
from jaxinfer import LLM, SamplingParams
model, cache, max_len, seqs, tokens = sys.argv[1:6]
llm = LLM(model, compilation_cache_dir=cache, max_model_len=int(max_len), max_num_seqs=int(seqs),
          max_num_batched_tokens=int(tokens))
llm.generate(["w5 w6 w7"], SamplingParams(max_tokens=1), use_tqdm=False)
print("FIRST TOKEN", flush=True)
"""


def first_token(args, model: str, cache: str) -> tuple[float, float]:
    """(seconds from a fresh process's launch to `LLM(model)`'s first generated token, nan)."""
    sizes = (args.max_model_len, args.max_num_seqs, args.max_num_batched_tokens)
    cmd = [sys.executable, "-c", OFFLINE, model, cache, *map(str, sizes)]
    t0 = time.perf_counter()
    child = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        for line in child.stdout:
            if line.startswith("FIRST TOKEN"):
                return time.perf_counter() - t0, float("nan")
        raise SystemExit(f"the LLM process exited with {child.wait()} before its first token")
    finally:
        child.kill()
        child.wait(60)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--ckpt", default=os.path.join(tempfile.gettempdir(), "qwen3_random"))
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--tiny", action="store_true")
    for name, default in (
        ("max-model-len", 2048),
        ("max-num-seqs", 256),
        ("max-num-batched-tokens", 8192),
    ):
        ap.add_argument("--" + name, type=int, default=default)
    ap.add_argument(
        "--precompile",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="the server compiles the planned set before /health (default: the server's, on a GPU)",
    )
    ap.add_argument("--offline", action="store_true", help="LLM() to its first token instead")
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--out", default="benchmarks/h200.jsonl")
    return ap


def server_cmd(args, model: str, cache: str) -> list[str]:
    cmd = [sys.executable, "-m", "jaxinfer.serve", "--model", model, "--log-level", "warning"]
    cmd += ["--compilation-cache-dir", cache, "--max-model-len", str(args.max_model_len)]
    cmd += ["--max-num-seqs", str(args.max_num_seqs)]
    cmd += ["--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    if args.precompile is not None:
        cmd.append("--precompile" if args.precompile else "--no-precompile")
    return cmd


def main() -> None:
    args = parser().parse_args()
    if args.tiny:
        args.layers, args.max_model_len, args.max_num_seqs = 2, 256, 16
        args.max_num_batched_tokens, args.ckpt = 256, args.ckpt + "_tiny"
    model = args.model or checkpoint(args.ckpt, TINY_HF if args.tiny else QWEN3_8B_HF, args.layers)
    cache = tempfile.mkdtemp(prefix="jaxinfer_cc_")
    cmd, rows = server_cmd(args, model, cache), []
    try:
        for cache_state in ("cold", "warm"):
            if args.offline:
                ready, compiles = first_token(args, model, cache)
            else:
                ready, compiles = start(cmd, args.timeout)
            rows.append(
                dict(
                    bench="startup_offline" if args.offline else "startup",
                    cache=cache_state,
                    health_s=ready,
                    compiled_shapes=compiles,
                    precompile=args.precompile,
                    model=args.model
                    or f"random qwen3-8b arch, {args.layers} layers" + " (tiny)" * args.tiny,
                    max_model_len=args.max_model_len,
                    max_num_seqs=args.max_num_seqs,
                    max_num_batched_tokens=args.max_num_batched_tokens,
                    date=datetime.date.today().isoformat(),
                    commit=git_commit(),
                    xla_flags=xla_flags(),
                )
            )
            what = "first token" if args.offline else "/health 200"
            print(
                f"{cache_state:>5} cache: {what} after {ready:6.1f} s, "
                f"{compiles:.0f} programs compiled",
                flush=True,
            )
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "a") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
