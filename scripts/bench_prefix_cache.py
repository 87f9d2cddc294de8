"""Prefix caching and parallel sampling benchmark (issue 18): one engine, each workload timed with
the prefix cache on and off (or n > 1 against independent requests) in the same run.

Modes (``--modes``, default all three):
  shared     ``--systems`` distinct ``--system-len``-token system prompts x ``--questions``
             questions of ``--min-q``..``--max-q`` tokens (shuffled), ``--output-len`` output
             tokens, greedy: mean TTFT and output tok/s, cache on vs off, and the fraction of
             requests whose tokens are identical (``token_match``; 1.0 in float32,
             while bf16 rounds a prompt computed in other chunks differently, which can flip a
             near-tied argmax of random weights).
  no-shared  bench_throughput.py's workload (``--num-requests`` random prompts of
             ``--min-input``..``--max-input`` tokens, ``--min-output``..``--max-output`` outputs):
             cache on vs off (no prefix is shared; on must not be slower).
  rl         ``--rl-prompts`` prompts of ``--rl-len`` tokens, n=``--rl-n``, ``--rl-output``
             output tokens, temperature 1, logprobs=1, against the same work as independent n=1
             requests without logprobs seeded as the samples (`sample_seed`) and n=``--rl-n``
             without logprobs: output tok/s, and the fraction of samples with tokens identical
             to the independent requests' (``token_match``).

Every step shape is compiled before each timed run (`LLM.precompile`), and the prefix cache is
reset before each. Model: a random-weight Qwen3-8B-architecture model built on the device
(``--layers``; bench_throughput.py's config), or ``--tiny``: a 2-layer random model in float32
with small workloads, which runs on the CPU in seconds (the smoke test). Prints a table and
appends one JSON object per run (bench="prefix_cache") to ``--out``.

    python scripts/bench_prefix_cache.py [--modes shared,no-shared,rl] [--tiny]
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from scripts.bench_throughput import QWEN3_8B_HF, workload  # noqa: E402
from scripts.run_info import git_commit, xla_flags  # noqa: E402

MODES = ("shared", "no-shared", "rl")
TINY = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    rope_theta=1e4,
    max_position_embeddings=4096,
    tie_word_embeddings=False,
    rms_norm_eps=1e-6,
)
TINY_SIZES = dict(
    systems=2,
    questions=3,
    system_len=40,
    min_q=4,
    max_q=12,
    output_len=4,
    num_requests=4,
    min_input=8,
    max_input=40,
    min_output=2,
    max_output=6,
    rl_prompts=2,
    rl_len=20,
    rl_n=3,
    rl_output=4,
    max_num_seqs=8,
    max_num_batched_tokens=64,
    layers=2,
)


def shared_workload(args, vocab: int):
    """(prompts, out_lens): every system prompt with every question, in a seeded random order."""
    rng = np.random.default_rng(args.seed)
    systems = [
        rng.integers(0, min(vocab, 10000), args.system_len).tolist() for _ in range(args.systems)
    ]
    prompts = [
        s
        + rng.integers(0, min(vocab, 10000), int(rng.integers(args.min_q, args.max_q + 1))).tolist()
        for s in systems
        for _ in range(args.questions)
    ]
    order = rng.permutation(len(prompts))
    return [prompts[i] for i in order], [args.output_len] * len(prompts)


def build_llm(args):
    import jax
    import jax.numpy as jnp

    from jaxinfer import LLM, models
    from jaxinfer.config import ModelConfig

    hf = TINY if args.tiny else QWEN3_8B_HF
    cfg = ModelConfig.from_hf_config(dict(hf, model_type="qwen3", num_hidden_layers=args.layers))
    dtype = jnp.dtype(args.dtype or ("float32" if args.tiny else "bfloat16"))
    max_len = max(
        args.system_len + args.max_q + args.output_len,
        args.max_input + args.max_output,
        args.rl_len + args.rl_output,
    )
    kw = dict(
        max_model_len=max_len,
        max_num_seqs=args.max_num_seqs,
        dtype=args.dtype,
        max_num_batched_tokens=args.max_num_batched_tokens,
        kernels=args.kernels,
    )
    if args.num_pages:
        kw["num_pages"] = args.num_pages
    return LLM.from_params(cfg, models.init_params(cfg, jax.random.key(0), dtype), **kw), cfg


def timed(llm, prompts, params, *, caching: bool) -> tuple[dict, list]:
    """One timed run on a reset cache: (row, outputs)."""
    eng = llm.engine
    assert llm.reset_prefix_cache(), "the engine is not idle"
    eng.block_manager.enable_prefix_caching = caching
    reqs = [{"prompt_token_ids": p} for p in prompts]
    pre = llm.precompile(reqs, params)
    lazy, hits, queries = (
        eng.stats().num_lazy_compiles,
        eng.stats().prefix_cache_hits,
        eng.stats().prefix_cache_queries,
    )
    t = time.perf_counter()
    outs = llm.generate(reqs, params)
    dt = time.perf_counter() - t
    n_out = sum(len(c.token_ids) for o in outs for c in o.outputs)
    ttft = [o.metrics.ttft_s for o in outs if o.metrics is not None]
    q = eng.stats().prefix_cache_queries - queries
    row = dict(
        prefix_caching=caching,
        seconds=dt,
        requests=len(prompts),
        output_tokens=n_out,
        output_tok_s=n_out / dt,
        mean_ttft_s=float(np.mean(ttft)) if ttft else None,
        hit_rate=(eng.stats().prefix_cache_hits - hits) / q if q else 0.0,
        cached_tokens=sum(o.num_cached_tokens for o in outs),
        precompile_s=pre["seconds"],
        compiles_in_timed_run=eng.stats().num_lazy_compiles - lazy,
    )
    eng.block_manager.enable_prefix_caching = True
    return row, outs


def tokens(outs):
    return [[list(c.token_ids) for c in o.outputs] for o in outs]


def on_vs_off(llm, prompts, out_lens, abba: bool = False):
    """Greedy, ignore_eos: the cache off, then on (``abba``: off, on, on, off, so that a drift
    across the process shows); an on row has ``token_match``."""
    from jaxinfer import SamplingParams

    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in out_lens]
    rows, first = [], None
    for i, caching in enumerate((False, True, True, False) if abba else (False, True)):
        row, outs = timed(llm, prompts, params, caching=caching)
        first = first or tokens(outs)
        same = np.mean([x == y for x, y in zip(tokens(outs), first)])
        rows.append(
            dict(
                row,
                run=f"cache {'on' if caching else 'off'}" + (f" ({i + 1})" * abba),
                **(dict(token_match=float(same)) if caching else {}),
            )
        )
    return rows


def run_shared(llm, args, vocab):
    return on_vs_off(llm, *shared_workload(args, vocab), abba=args.abba)


def run_no_shared(llm, args, vocab):
    return on_vs_off(llm, *workload(args, vocab), abba=args.abba)


def run_rl(llm, args, vocab):
    from jaxinfer import SamplingParams
    from jaxinfer.engine.llm_engine import sample_seed

    rng = np.random.default_rng(args.seed + 1)
    prompts = [
        rng.integers(0, min(vocab, 10000), args.rl_len).tolist() for _ in range(args.rl_prompts)
    ]
    common = dict(temperature=1.0, max_tokens=args.rl_output, ignore_eos=True)
    grouped = [
        SamplingParams(n=args.rl_n, seed=i, logprobs=1, **common) for i in range(len(prompts))
    ]
    alone = [
        SamplingParams(seed=sample_seed(i, j), **common)
        for i in range(len(prompts))
        for j in range(args.rl_n)
    ]
    plain = [dataclasses.replace(p, logprobs=None) for p in grouped]
    ind, o_ind = timed(llm, [p for p in prompts for _ in range(args.rl_n)], alone, caching=True)
    rows = [dict(ind, run=f"{len(alone)} x n=1")]
    for name, params in ((f"n={args.rl_n}", plain), (f"n={args.rl_n}, logprobs=1", grouped)):
        row, o_n = timed(llm, prompts, params, caching=True)
        if params is grouped and any(
            len(c.logprobs or ()) != len(c.token_ids) for o in o_n for c in o.outputs
        ):
            raise SystemExit("rl: logprobs missing")
        flat = [s for o in tokens(o_n) for s in o]
        rows.append(
            dict(
                row,
                run=name,
                token_match=float(np.mean([s == o[0] for s, o in zip(flat, tokens(o_ind))])),
            )
        )
    return rows


def parse_args(argv):
    """``(args, modes)`` from the command line ``argv`` (see the module docstring): with
    ``--tiny``, every TINY_SIZES size not given explicitly; exits with a usage error on an unknown
    mode."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma-separated of {MODES}")
    ap.add_argument(
        "--tiny",
        action="store_true",
        help="2-layer random model, tiny workloads "
        "(CPU smoke test); explicit size flags still apply",
    )
    ap.add_argument("--layers", type=int, default=None, help="default 36 (tiny: 2)")
    ap.add_argument("--systems", type=int, default=32)
    ap.add_argument("--questions", type=int, default=8)
    ap.add_argument("--system-len", type=int, default=2048)
    ap.add_argument("--min-q", type=int, default=64)
    ap.add_argument("--max-q", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--min-input", type=int, default=100)
    ap.add_argument("--max-input", type=int, default=1024)
    ap.add_argument("--min-output", type=int, default=100)
    ap.add_argument("--max-output", type=int, default=1024)
    ap.add_argument("--rl-prompts", type=int, default=64)
    ap.add_argument("--rl-len", type=int, default=512)
    ap.add_argument("--rl-n", type=int, default=8)
    ap.add_argument("--rl-output", type=int, default=512)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--num-pages", type=int, default=None, help="KV pool pages (default: plan)")
    ap.add_argument("--kernels", default="", metavar="SPEC", help="KernelConfig.parse spec")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default=None)
    ap.add_argument(
        "--abba",
        action="store_true",
        help="shared, no-shared: the cache off, on, "
        "on, off (a drift over the run shows as off (1) against off (4))",
    )
    ap.add_argument("--out", default="benchmarks/h200.jsonl")
    args = ap.parse_args(argv)
    if args.tiny:  # tiny sizes unless given explicitly
        given = {a.split("=")[0].lstrip("-").replace("-", "_") for a in argv if a.startswith("--")}
        for k, v in TINY_SIZES.items():
            if k not in given:
                setattr(args, k, v)
    args.layers = args.layers or 36
    modes = [m for m in args.modes.split(",") if m]
    if bad := [m for m in modes if m not in MODES]:
        ap.error(f"--modes {args.modes!r}: unknown {bad}; allowed {list(MODES)}")
    return args, modes


def workload_sizes(mode, args) -> dict:
    """The workload sizes recorded with each row of ``mode``."""
    return dict(
        shared=dict(
            systems=args.systems,
            questions=args.questions,
            system_len=args.system_len,
            q_range=[args.min_q, args.max_q],
            output_len=args.output_len,
        ),
        rl=dict(
            prompts=args.rl_prompts,
            prompt_len=args.rl_len,
            n=args.rl_n,
            output_len=args.rl_output,
        ),
    ).get(
        mode,
        dict(
            num_requests=args.num_requests,
            input_range=[args.min_input, args.max_input],
            output_range=[args.min_output, args.max_output],
        ),
    )


def run_mode(mode, llm, args, vocab, meta) -> list[dict]:
    """Run ``mode``'s workload: its rows, each completed with the mode, workload sizes, speedup
    and TTFT ratio against the mode's first row, appended to ``--out`` with ``meta`` and printed
    as one line, as it completes."""
    run = dict(zip(MODES, (run_shared, run_no_shared, run_rl)))
    sizes = workload_sizes(mode, args)
    rows = run[mode](llm, args, vocab)
    base = rows[0]
    for r in rows:
        r.update(
            mode=mode,
            workload=sizes,
            speedup=r["output_tok_s"] / base["output_tok_s"],
            ttft_ratio=(
                base["mean_ttft_s"] / r["mean_ttft_s"]
                if r["mean_ttft_s"] and base["mean_ttft_s"]
                else None
            ),
        )
        with open(args.out, "a") as fh:
            fh.write(json.dumps(dict(meta, **r)) + "\n")
        print(f"{mode} {r['run']}: {r['output_tok_s']:.1f} output tok/s", flush=True)
    return rows


def print_table(table) -> None:
    """The final table, one line per row of every mode."""
    print(
        f"\n{'mode':<10} {'run':<20} {'out tok/s':>10} {'x base':>7} {'TTFT ms':>9} "
        f"{'TTFT /':>7} {'hit rate':>8} {'lazy':>5} {'same tokens':>11}"
    )
    for r in table:
        ttft = f"{r['mean_ttft_s'] * 1e3:.1f}" if r["mean_ttft_s"] is not None else "-"
        ratio = f"{r['ttft_ratio']:.2f}" if r["ttft_ratio"] else "-"
        print(
            f"{r['mode']:<10} {r['run']:<20} {r['output_tok_s']:>10.1f} {r['speedup']:>7.2f} "
            f"{ttft:>9} {ratio:>7} {r['hit_rate']:>8.2f} {r['compiles_in_timed_run']:>5} "
            f"{r.get('token_match', float('nan')):>11.2f}"
        )


def main() -> None:
    args, modes = parse_args(sys.argv[1:])
    import jax

    llm, cfg = build_llm(args)
    meta = dict(
        bench="prefix_cache",
        model="tiny random qwen3" if args.tiny else f"random qwen3-8b arch, {args.layers} layers",
        device=jax.devices()[0].device_kind,
        num_pages=llm.engine.runner.num_pages,
        jax=jax.__version__,
        date=datetime.date.today().isoformat(),
        commit=git_commit(),
        xla_flags=xla_flags(),
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
    )
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    table = []
    for mode in modes:
        table += run_mode(mode, llm, args, cfg.vocab_size, meta)
    print_table(table)


if __name__ == "__main__":
    main()
