"""Offline throughput in the style of nano-vllm's bench.py: N requests with random token-id prompts,
input lengths uniform in [--min-input, --max-input], output lengths uniform in
[--min-output, --max-output], ignore_eos, fixed seed, all submitted at once.

Before the timed run, every step shape the workload visits is compiled ahead of time, in parallel
(`LLM.precompile`: a host dry run of the scheduler lists the shapes), so the timed run compiles
nothing (``compiles_in_timed_run`` in the row). Reports total output tok/s, mean TTFT and TPOT,
P50/P99 request latency. ``--compare hf`` runs the
same workload through HF transformers ``generate`` on the same weights in the same run (batches of
``--hf-batch`` requests, left-padded, each batch generating its longest requested output; only the
requested tokens count; ``--hf-requests N`` runs HF on the first N requests only, an i.i.d. sample,
and compares tok/s: the row records ``num_requests_run``). HF runs first and releases the GPU
before JAX starts (JAX keeps the memory it allocates). Appends JSON objects (bench="throughput")
to ``--out``.

Model: ``--model DIR`` (HF safetensors dir, GGUF file or Orbax dir); default: a random-weight model
with the published Qwen3-8B architecture (``--layers`` of them): with ``--compare hf`` written once
as an HF checkpoint to ``--random-dir`` so both engines load identical weights, otherwise built
directly on the device (``LLM.from_params``).

Kernels: ``--kernels SPEC`` (`KernelConfig.parse`, e.g. ``decode=mosaic,batch_buckets=1:2:4:256``),
resolved by the engine; default: the engine's default. Counters come from ``llm.engine.stats()``.

    python scripts/bench_throughput.py [--num-requests 256] [--compare hf] [--model DIR]
        [--kernels SPEC]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from jaxinfer.config import KernelConfig  # noqa: E402
from scripts import step_tools  # noqa: E402
from scripts.run_info import git_commit, xla_flags  # noqa: E402
from scripts.step_tools import TracedStepLog, record_steps, step_phases, trace_summary  # noqa: E402,F401

QWEN3_8B_HF = dict(
    vocab_size=151936,
    hidden_size=4096,
    intermediate_size=12288,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    rope_theta=1e6,
    max_position_embeddings=40960,
    tie_word_embeddings=False,
    rms_norm_eps=1e-6,
)


def random_qwen3_checkpoint(path: str, layers: int) -> str:
    """Write (once) a random-weight Qwen3-8B-architecture HF checkpoint in bf16 to ``path``."""
    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(num_hidden_layers=layers, **QWEN3_8B_HF)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = Qwen3ForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(path)
    del model
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return path


def workload(args, vocab: int):
    rng = np.random.default_rng(args.seed)
    n = args.num_requests
    in_lens = rng.integers(args.min_input, args.max_input + 1, n)
    out_lens = rng.integers(args.min_output, args.max_output + 1, n)
    prompts = [rng.integers(0, min(vocab, 10000), int(k)).tolist() for k in in_lens]
    return prompts, [int(x) for x in out_lens]


def summarize(name, t_total, n_out, ttft, tpot, latency) -> dict:
    return dict(
        engine=name,
        seconds=t_total,
        output_tokens=n_out,
        output_tok_s=n_out / t_total,
        mean_ttft_s=float(np.mean(ttft)) if ttft else None,
        mean_tpot_s=float(np.mean(tpot)) if tpot else None,
        p50_latency_s=float(np.percentile(latency, 50)) if latency else None,
        p99_latency_s=float(np.percentile(latency, 99)) if latency else None,
    )


def make_llm(path, args):
    """The engine under test: ``path``'s checkpoint, or with no path random Qwen3-8B-architecture
    weights (``--layers``) built on the device; sized and configured by ``args``."""
    from jaxinfer import LLM

    kw = dict(
        max_model_len=args.max_input + args.max_output,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        dtype=args.dtype,
        kernels=args.kernels,
        tensor_parallel_size=args.tensor_parallel_size,
        quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype,
    )
    if path is None:  # random weights built on the device: no checkpoint to write or read
        import jax
        import jax.numpy as jnp

        from jaxinfer import models
        from jaxinfer.config import ModelConfig

        cfg = ModelConfig.from_hf_config(
            dict(QWEN3_8B_HF, model_type="qwen3", num_hidden_layers=args.layers)
        )
        dtype = jnp.dtype(args.dtype or "bfloat16")
        return LLM.from_params(cfg, models.init_params(cfg, jax.random.key(0), dtype), **kw)
    return LLM(path, skip_tokenizer_init=True, **kw)


def precompile(llm, reqs, params, args) -> dict:
    """`LLM.precompile` of every step shape the workload visits, with a line before and after;
    its result."""
    eng = llm.engine
    kc = eng.resolved.kernels
    print(
        f"jaxinfer: model loaded, KV pool {eng.runner.num_pages} pages, kernels {kc}; "
        "compiling the step shapes the workload visits (host dry run)",
        flush=True,
    )
    pre = llm.precompile(reqs, params, max_workers=args.compile_workers)
    print(
        f"jaxinfer: {pre['shapes']} shapes compiled in {pre['seconds']:.0f} s "
        f"({pre['lower_s']:.0f} s of it tracing, {pre['warm_s']:.1f} s first runs)",
        flush=True,
    )
    return pre


def request_latencies(outs) -> tuple[list, list, list]:
    """``(ttft, tpot, latency)`` in seconds from each output's metrics (TPOT only for outputs of
    more than one token)."""
    ttft, tpot, lat = [], [], []
    for o in outs:
        m, k = o.metrics, len(o.token_ids)
        ttft.append(m.ttft_s)
        lat.append(m.finish_time - m.arrival_time)
        if k > 1:
            tpot.append((m.finish_time - m.first_token_time) / (k - 1))
    return ttft, tpot, lat


def run_jaxinfer(path, prompts, out_lens, args) -> dict:
    """The timed jaxinfer run (after precompiling): its summary row, with compile counts, the
    step phases, the resolved kernels and, with ``--trace-steps``, the trace summary."""
    from jaxinfer import SamplingParams

    llm = make_llm(path, args)
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in out_lens]
    reqs = [{"prompt_token_ids": p} for p in prompts]
    eng = llm.engine
    kc = eng.resolved.kernels
    pre = precompile(llm, reqs, params, args)
    lazy_before = eng.stats().num_lazy_compiles
    if args.trace_steps:
        import tempfile

        steps = record_steps(eng, TracedStepLog(*args.trace_steps, tempfile.mkdtemp()))
    else:
        steps = record_steps(eng, [])
    t = time.perf_counter()
    outs = llm.generate(reqs, params, use_tqdm=True)
    dt = time.perf_counter() - t
    phases = step_phases(steps, t)
    ttft, tpot, lat = request_latencies(outs)
    assert [len(o.token_ids) for o in outs] == out_lens
    row = summarize("jaxinfer", dt, sum(out_lens), ttft, tpot, lat)
    row.update(
        compiles=eng.stats().num_compiles,
        compiles_in_timed_run=eng.stats().num_lazy_compiles - lazy_before,
        precompile_s=pre["seconds"],
        precompile_lower_s=pre["lower_s"],
        precompile_warm_s=pre["warm_s"],
        compile_workers=args.compile_workers,
        batch_buckets=list(eng.runner.buckets.batch),
        phases=phases,
        kernels=args.kernels,
        attention=kc.decode_attention,
        prefill_attention=kc.prefill_attention,
        num_pages=eng.runner.num_pages,
        prefill_gemm=kc.prefill_gemm,
        cublas_decode_min_batch=kc.cublas_decode_min_batch,
    )
    if args.trace_steps:
        row["trace"] = trace_summary(steps)
    return row


def run_hf(path, prompts, out_lens, args) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from checkpoints_tools.loader import detect_format

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = getattr(torch, args.dtype or ("bfloat16" if dev == "cuda" else "float32"))
    if detect_format(path) == "gguf":
        d, f = os.path.split(path)
        model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    model = model.to(dev).eval()
    pad = 0
    t = time.perf_counter()
    lat = []
    with torch.inference_mode():
        for i in range(0, len(prompts), args.hf_batch):
            ps, ns = prompts[i : i + args.hf_batch], out_lens[i : i + args.hf_batch]
            L = max(len(p) for p in ps)
            ids = torch.tensor([[pad] * (L - len(p)) + p for p in ps], device=dev)
            mask = torch.tensor([[0] * (L - len(p)) + [1] * len(p) for p in ps], device=dev)
            model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=max(ns),
                min_new_tokens=max(ns),
                do_sample=False,
                pad_token_id=pad,
            )
            if dev == "cuda":
                torch.cuda.synchronize()
            lat += [time.perf_counter() - t] * len(ps)
    dt = time.perf_counter() - t
    del model
    if dev == "cuda":
        torch.cuda.empty_cache()
    return summarize("hf_transformers", dt, sum(out_lens), [], [], lat)


def parse_args():
    """The command line (see the module docstring); exits with a usage error on a bad
    ``--kernels`` spec or ``--trace-steps`` below 1."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--random-dir", default="/tmp/jaxinfer_random_qwen3_8b")
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--min-input", type=int, default=100)
    ap.add_argument("--max-input", type=int, default=1024)
    ap.add_argument("--min-output", type=int, default=100)
    ap.add_argument("--max-output", type=int, default=1024)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument(
        "--kernels",
        default="",
        metavar="SPEC",
        help="the engine's kernel config (KernelConfig.parse, resolved by the engine; "
        "'' = the default). Keys: " + KernelConfig.help(),
    )
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default=None)
    ap.add_argument("--tensor-parallel-size", type=int, default=1)
    ap.add_argument("--quantization", choices=["fp8"], default=None, help="fp8 weights")
    ap.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], default="auto")
    ap.add_argument(
        "--compile-workers",
        type=int,
        default=None,
        help="parallel ahead-of-time compiles (default: one per CPU, up to the shapes)",
    )
    ap.add_argument("--compare", choices=["hf"], default=None)
    ap.add_argument("--hf-batch", type=int, default=64)
    ap.add_argument(
        "--hf-requests",
        type=int,
        default=None,
        help="HF runs only the first N requests (an i.i.d. sample of the workload; "
        "its tok/s is compared): HF takes ~390 s for all 256 on an H200",
    )
    ap.add_argument(
        "--trace-steps",
        type=int,
        nargs=2,
        metavar=("START", "COUNT"),
        default=None,
        help="profile steps START..START+COUNT of the timed run (JAX profiler; the "
        "row gets their kernel table and the device's idle gaps)",
    )
    ap.add_argument("--out", default="benchmarks/h200.jsonl")
    args = ap.parse_args()
    try:
        KernelConfig.parse(args.kernels)
    except ValueError as e:
        ap.error(str(e))
    if args.trace_steps and (args.trace_steps[0] < 1 or args.trace_steps[1] < 1):
        ap.error(f"--trace-steps {args.trace_steps}: START and COUNT must be >= 1")
    return args


def workload_vocab(path) -> int:
    """The vocabulary the random prompts draw from: the checkpoint's (an HF directory), Qwen3-8B's
    for random weights, else 49152."""
    from jaxinfer.config import ModelConfig
    from jaxinfer.runner.loading import load_params  # noqa: F401 (import check before timing)

    return (
        ModelConfig.from_checkpoint(path).vocab_size
        if path and os.path.isfile(os.path.join(path, "config.json"))
        else QWEN3_8B_HF["vocab_size"]
        if path is None
        else 49152
    )


def print_engines(rows) -> None:
    """The per-engine table: output tok/s, mean TTFT and TPOT, P50 and P99 latency."""
    print(
        f"\n{'engine':<16} {'out tok/s':>10} {'TTFT ms':>8} {'TPOT ms':>8} {'P50 s':>7} "
        f"{'P99 s':>7}"
    )
    for r in rows:
        f = lambda x, s=1e3: f"{x * s:.1f}" if x is not None else "-"  # noqa: E731
        print(
            f"{r['engine']:<16} {r['output_tok_s']:>10.1f} {f(r['mean_ttft_s']):>8} "
            f"{f(r['mean_tpot_s']):>8} {f(r['p50_latency_s'], 1):>7} {f(r['p99_latency_s'], 1):>7}"
        )


def main() -> None:
    args = parse_args()
    import jax

    # HF needs a checkpoint on disk; jaxinfer alone builds random weights on the device
    path = args.model or (
        random_qwen3_checkpoint(args.random_dir, args.layers) if args.compare == "hf" else None
    )
    vocab = workload_vocab(path)
    prompts, out_lens = workload(args, vocab)
    commit = git_commit()
    # no jax.devices() before HF has run: it would make JAX take its memory pool first
    meta = dict(
        bench="throughput",
        model=args.model or f"random qwen3-8b arch, {args.layers} layers",
        num_requests=args.num_requests,
        input_range=[args.min_input, args.max_input],
        output_range=[args.min_output, args.max_output],
        seed=args.seed,
        tensor_parallel_size=args.tensor_parallel_size,
        quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype,
        jax=jax.__version__,
        date=datetime.date.today().isoformat(),
        commit=commit,
        xla_flags=xla_flags(),
    )
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    t0 = time.perf_counter()

    def record(row: dict, device: str) -> None:  # written at once: a later kill loses nothing
        with open(args.out, "a") as fh:
            fh.write(json.dumps(dict(meta, device=device, **row)) + "\n")
        print(
            f"[{time.perf_counter() - t0:.0f} s] {row['engine']}: {row['output_tok_s']:.1f} "
            f"output tok/s",
            flush=True,
        )

    hf = None
    if args.compare == "hf":
        import torch

        k = args.hf_requests or len(prompts)
        hf = run_hf(path, prompts[:k], out_lens[:k], args)
        hf["num_requests_run"] = k
        record(hf, torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu")
    rows = [run_jaxinfer(path, prompts, out_lens, args)]
    if hf is not None:
        rows.append(hf)
        rows[0]["speedup_vs_hf"] = rows[0]["output_tok_s"] / rows[1]["output_tok_s"]
    record(rows[0], jax.devices()[0].device_kind)
    print_engines(rows)
    step_tools.print_step_phases(rows[0]["phases"])
    step_tools.print_trace_summary(rows[0].get("trace"), args.trace_steps)
    if args.compare == "hf":
        print(f"speedup vs HF: {rows[0]['speedup_vs_hf']:.2f}x")


if __name__ == "__main__":
    main()
