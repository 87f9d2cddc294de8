"""Online serving benchmark: Poisson arrivals against the OpenAI-compatible server.

In the manner of vLLM's benchmark_serving.py: an asyncio client (the official ``openai``
package) sends bench_throughput.py's workload (random token-id prompts, uniform input and output
lengths, ignore_eos, greedy, fixed seed) to the server with Poisson arrivals at each of
``--rates`` requests/s (``inf``: all at once, saturation), and reports per rate: request
throughput, output tok/s, TTFT, TPOT (per request: (latency - TTFT) / (tokens - 1)) and
inter-token latency (gaps between streamed chunks; one chunk per engine step) P50/P99; a table,
one JSON line per rate (bench="serving") in ``--out``, and a PNG of latency against the achieved
rate (``--png``; needs matplotlib).

The server: ``--base-url`` (one already running), else a child process this script starts:
``--model PATH`` (``embedded``: SmolLM2) runs ``python -m jaxinfer.serve``; no ``--model``: a
random-weight model of the published Qwen3-8B architecture (``--layers``) built on the device,
which first runs the same workload offline (`LLM.generate`, the shapes compiled ahead of time as
in bench_throughput.py) and reports its output tok/s, the reference of the rate ``inf`` row
(``offline_output_tok_s``). The server compiles the whole planned set (`BucketSpec.planned`)
before ``/health`` answers when it precompiles (``--precompile``/``--no-precompile``, passed on;
default: the server's, on a GPU). Each rate runs untimed first until a run compiles no new
program (at most ``--warmup`` runs); ``compiles`` counts the programs compiled during the timed
run and ``lazy_compiles`` those compiled inside a step (the server's ``jaxinfer:lazy_compiles``;
each one a stall in its latencies). ``--no-background-compile`` is gone: no step runs padded
while its shape compiles any more.

``--soak``: ``--soak-requests`` (1,000) over ``--soak-seconds`` (600) with 10% of the clients
disconnecting mid-stream and 5% malformed requests; checks that every good request got all its
tokens and every bad one a 4xx, and compares the server's resident memory after the run with
after warm-up (the first 10%). ``--tiny``: a small random model and workload, a CPU smoke run.

    python scripts/bench_serving.py [--rates 2,4,8,16,inf] [--model PATH] [--soak] [--tiny]
    python scripts/bench_serving.py --tiny --soak --soak-requests 1000 --soak-seconds 600  # CPU
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from scripts.bench_throughput import QWEN3_8B_HF, workload  # noqa: E402
from scripts.run_info import git_commit, xla_flags  # noqa: E402
from scripts.serving_client import MODEL, metric, run_rate, soak  # noqa: E402

TINY_HF = dict(
    QWEN3_8B_HF,
    vocab_size=4096,
    hidden_size=128,
    intermediate_size=256,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=4096,
)


def random_llm(args):
    """In the engine-core process: a random-weight model, the workload run offline once (timed;
    its shapes compiled first); the offline row on stdout, tagged."""
    import jax
    import jax.numpy as jnp

    from jaxinfer import LLM, SamplingParams, models
    from jaxinfer.config import ModelConfig

    hf = dict(
        TINY_HF if args.tiny else QWEN3_8B_HF, model_type="qwen3", num_hidden_layers=args.layers
    )
    cfg = ModelConfig.from_hf_config(hf)
    opts = engine_args(args)
    if opts["precompile"] is None:  # the server's default
        opts["precompile"] = jax.default_backend() == "gpu"
    llm = LLM.from_params(
        cfg, models.init_params(cfg, jax.random.key(0), jnp.dtype(args.dtype or "bfloat16")), **opts
    )
    prompts, out_lens = workload(args, cfg.vocab_size)
    reqs = [{"prompt_token_ids": p} for p in prompts]
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in out_lens]
    llm.precompile(reqs, params)  # the offline run's shapes (planned already if precompiled)
    trace = None
    if args.trace_steps:
        from scripts.probes.step_trace import StepTrace

        trace = StepTrace(llm.engine, args.trace_steps)
        trace.mark("offline")
    t = time.perf_counter()
    llm.generate(reqs, params)
    dt = time.perf_counter() - t
    print(
        "OFFLINE "
        + json.dumps(
            dict(
                offline_output_tok_s=sum(out_lens) / dt,
                offline_s=dt,
                device=str(jax.devices()[0].device_kind),
            )
        ),
        flush=True,
    )
    if trace is not None:
        trace.mark("server")
    return llm


def serve_random(args) -> int:
    """The child: `jaxinfer.serve`'s API process over `random_llm` in its engine core."""
    import functools

    from jaxinfer.serve.__main__ import main

    return main(
        ["--port", str(args.port), "--served-model-name", MODEL, "--log-level", "warning"],
        functools.partial(random_llm, args),
    )


def engine_args(args) -> dict:
    return dict(
        max_model_len=args.max_input + args.max_output,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        dtype=args.dtype,
        kernels=args.kernels,
        precompile=args.precompile,
    )


def start_server(args) -> tuple[subprocess.Popen, str, dict]:
    """(child, base URL, offline row or {}) once the child answers /health."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    if args.model is None:
        cmd = [
            sys.executable,
            os.path.abspath(__file__),
            "--serve-random",
            "--port",
            str(port),
            *sys.argv[1:],
        ]
    else:
        cmd = [
            sys.executable,
            "-m",
            "jaxinfer.serve",
            "--port",
            str(port),
            "--log-level",
            "warning",
            "--served-model-name",
            MODEL,
            *(["--model", args.model] if args.model != "embedded" else []),
        ]
        for k, v in engine_args(args).items():
            if isinstance(v, bool):
                cmd.append("--" + "no-" * (not v) + k.replace("_", "-"))
            elif v not in (None, ""):
                cmd += ["--" + k.replace("_", "-"), str(v)]
    import tempfile

    log = open(os.path.join(tempfile.gettempdir(), "bench_serving_server.log"), "w")
    child = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True, cwd=ROOT)
    url, offline = f"http://127.0.0.1:{port}", {}
    import threading

    def read():  # the offline row, then keep the pipe drained
        for line in child.stdout:
            if line.startswith("OFFLINE "):
                offline.update(json.loads(line[8:]))

    threading.Thread(target=read, daemon=True).start()
    while True:
        if child.poll() is not None:
            raise SystemExit(f"the server exited with {child.returncode}; see {log.name}")
        try:
            urllib.request.urlopen(url + "/health", timeout=1)
            return child, url + "/v1", offline
        except OSError:
            time.sleep(1)


def plot(rows: list[dict], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no PNG")
        return
    rows = sorted(rows, key=lambda r: r["request_throughput"])
    x = [r["request_throughput"] for r in rows]
    fig, ax = plt.subplots(1, 2, figsize=(10, 4))
    for name in ("ttft", "tpot", "itl"):
        for q, style in (("p50", "-o"), ("p99", "--x")):
            (ax[0] if name == "ttft" else ax[1]).plot(
                x, [r[f"{name}_{q}_ms"] for r in rows], style, label=f"{name.upper()} {q}"
            )
    for a in ax:
        a.set_xlabel("achieved request rate (req/s)")
        a.set_ylabel("ms")
        a.set_yscale("log")
        a.legend()
    fig.suptitle("jaxinfer serving: latency against request rate")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    print(f"plot: {path}")


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base-url", default=None, help="a running server's /v1 URL")
    ap.add_argument("--model", default=None, help="PATH or 'embedded'; default: random Qwen3-8B")
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--tiny", action="store_true", help="small random model and workload (CPU)")
    ap.add_argument("--rates", default="2,4,8,16,32,inf", help="requests/s, comma-separated")
    ap.add_argument(
        "--warmup",
        type=int,
        default=3,
        help="most untimed runs of each rate first (until one compiles nothing)",
    )
    for name, default in (
        ("num-requests", 256),
        ("min-input", 100),
        ("max-input", 1024),
        ("min-output", 100),
        ("max-output", 1024),
        ("seed", 0),
        ("max-num-seqs", 256),
        ("max-num-batched-tokens", 8192),
        ("soak-requests", 1000),
        ("soak-seconds", 600),
    ):
        ap.add_argument("--" + name, type=int, default=default)
    ap.add_argument("--kernels", default="")
    ap.add_argument(
        "--client-procs",
        type=int,
        default=1,
        help="client processes the requests are dealt to (default 1)",
    )
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default=None)
    ap.add_argument("--soak", action="store_true")
    ap.add_argument(
        "--precompile",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="the server compiles every planned step shape before /health (default: the "
        "server's, on a GPU)",
    )
    ap.add_argument(
        "--trace-steps",
        default=None,
        metavar="PATH",
        help="random model: each engine step's times into PATH "
        "(scripts/probes/step_trace.py summarizes)",
    )
    ap.add_argument("--out", default="benchmarks/serving.jsonl")
    ap.add_argument("--png", default=None, help="default: --out with .png")
    ap.add_argument("--serve-random", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    return ap


TINY_DEFAULTS = dict(
    layers=2,
    num_requests=24,
    min_input=16,
    max_input=96,
    min_output=8,
    max_output=48,
    max_num_seqs=16,
    max_num_batched_tokens=256,
    rates="8,inf",
    soak_requests=200,
    soak_seconds=60,
    dtype="float32",
)


def timed_rate(args, url, prompts, out_lens, rate: float, meta: dict, offline: dict) -> dict:
    """Untimed runs of ``rate`` until one compiles nothing (at most ``--warmup``), then the
    timed run's row, with the programs compiled (``compiles``, ``lazy_compiles``) during it."""
    for _ in range(args.warmup):
        compiles = metric(url, "compiled_step_shapes")
        run_rate(url, prompts, out_lens, rate, args.seed, args.client_procs)
        if metric(url, "compiled_step_shapes") == compiles:
            break
    compiles, lazy = (metric(url, m) for m in ("compiled_step_shapes", "lazy_compiles"))
    if args.trace_steps:  # the timed run's start in the trace's clock (perf_counter)
        with open(args.trace_steps + ".marks", "a") as f:
            f.write(json.dumps({"mark": f"timed rate {rate}", "t": time.perf_counter()}) + "\n")
    row = dict(
        meta,
        **run_rate(url, prompts, out_lens, rate, args.seed, args.client_procs),
        compiles=metric(url, "compiled_step_shapes") - compiles,
        lazy_compiles=metric(url, "lazy_compiles") - lazy,
    )
    if row["rate"] == "inf" and offline:
        row["vs_offline"] = row["output_tok_s"] / offline["offline_output_tok_s"]
    print(
        f"rate {row['rate']:>5}: {row['request_throughput']:7.2f} req/s "
        f"{row['output_tok_s']:9.1f} tok/s  TTFT p50/p99 {row['ttft_p50_ms']:8.1f}/"
        f"{row['ttft_p99_ms']:8.1f} ms  TPOT {row['tpot_p50_ms']:7.2f}/"
        f"{row['tpot_p99_ms']:7.2f} ms  ITL {row['itl_p50_ms']:7.2f}/"
        f"{row['itl_p99_ms']:7.2f} ms  incomplete {row['incomplete']}  compiles "
        f"{row['compiles']:.0f} lazy compiles {row['lazy_compiles']:.0f}"
        + (f"  vs offline {row['vs_offline']:.3f}" if "vs_offline" in row else ""),
        flush=True,
    )
    return row


def run_meta(args, n: int, offline: dict) -> dict:
    return dict(
        bench="serving",
        model=args.model
        or f"random qwen3-8b arch, {args.layers} layers" + (" (tiny)" if args.tiny else ""),
        num_requests=n,
        input_range=[args.min_input, args.max_input],
        seed=args.seed,
        output_range=[args.min_output, args.max_output],
        max_num_seqs=args.max_num_seqs,
        client_procs=args.client_procs,
        precompile=args.precompile,
        date=datetime.date.today().isoformat(),
        commit=git_commit(),
        xla_flags=xla_flags(),
        **offline,
    )


def main() -> None:
    ap = parser()
    if "--tiny" in sys.argv[1:]:  # other defaults; explicit values stay
        ap.set_defaults(**TINY_DEFAULTS)
    args = ap.parse_args()
    if args.serve_random:
        sys.exit(serve_random(args))
    rates = [float(r) for r in args.rates.split(",")]
    vocab = 49152 if args.model else (TINY_HF if args.tiny else QWEN3_8B_HF)["vocab_size"]
    prompts, out_lens = workload(args, vocab)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    child, url, offline = (None, args.base_url, {}) if args.base_url else start_server(args)
    meta, rows = run_meta(args, len(prompts), offline), []
    try:
        if args.soak:
            row = dict(meta, mode="soak", **asyncio.run(soak(args, url, child, prompts, out_lens)))
            print(json.dumps(row, indent=1))
            rows.append(row)
        for rate in [] if args.soak else rates:
            rows.append(timed_rate(args, url, prompts, out_lens, rate, meta, offline))
    finally:
        if child is not None:
            child.terminate()
            child.wait(60)
    with open(args.out, "a") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    if rows and not args.soak:
        plot(rows, args.png or os.path.splitext(args.out)[0] + ".png")


if __name__ == "__main__":
    main()
