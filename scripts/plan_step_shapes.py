"""Host-only dry run of the throughput workload: its steps and compiled step shapes.

Runs the workload through the scheduler and the batch builder in the engine's step order
(`jaxinfer.engine.dry_run`: no JAX, no model) and counts the prefill and decode steps it takes
and the step shapes (compiled executables) it visits.

Every compiled shape costs a compile (about 8-12 s for the 36-layer Qwen3-8B step on the H200), so
this is how bucket choices are planned before spending device time. The workload is
bench_throughput.py's (same seed and ranges); sampled tokens are a constant (ignore_eos). Also
prints the bandwidth floor of the decode steps and the compute floor of the prefill GEMMs for a
model of ``--weight-gb`` / ``--params-b`` (defaults: Qwen3-8B on the H200), a bound, not a
measurement.

    python scripts/plan_step_shapes.py [--num-pages 36004] [--max-num-seqs 256]
        [--max-num-batched-tokens 8192] [--json FILE]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from jaxinfer.engine.block_manager import BlockManager  # noqa: E402
from jaxinfer.engine.dry_run import dry_run  # noqa: E402
from jaxinfer.engine.scheduler import Scheduler  # noqa: E402
from jaxinfer.sampling_params import SamplingParams  # noqa: E402
from jaxinfer.step_input import BucketSpec  # noqa: E402


def simulate(
    prompts,
    out_lens,
    *,
    num_pages,
    page_size,
    max_num_seqs,
    max_num_batched_tokens,
    max_model_len,
    buckets: BucketSpec,
    async_scheduling: bool = True,
) -> dict:
    """Run the workload to completion in the engine's step order (`jaxinfer.engine.dry_run`) and
    count steps and shapes."""
    bm = BlockManager(num_pages, page_size)
    sched = Scheduler(
        bm,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        page_size=page_size,
    )
    requests = [
        (list(p), SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
        for p, n in zip(prompts, out_lens)
    ]
    shapes: collections.Counter = collections.Counter()
    kinds: collections.Counter = collections.Counter()
    rows_real = rows_padded = 0
    prefill_real = prefill_padded = decode_kv_tokens = 0
    attn_rows_keys = 0  # sum over prefill steps of R * Tq * (M * page_size): the reference's logits
    for batch, hb in dry_run(sched, requests, buckets=buckets, async_scheduling=async_scheduling):
        kind = "prefill" if hb.key.packed else "decode"
        kinds[kind] += 1
        shapes[(kind, hb.key)] += 1
        if kind == "decode":
            rows_real += batch.num_seqs
            rows_padded += hb.tokens.shape[0]
            decode_kv_tokens += int(hb.seq_lens.sum())
        else:
            prefill_real += sum(batch.num_new_tokens)
            prefill_padded += hb.tokens.shape[1]
            attn_rows_keys += hb.q_index.size * hb.block_tables.shape[1] * page_size
    return dict(
        steps=dict(kinds),
        num_shapes=len(shapes),
        decode_rows=rows_real,
        decode_row_padding=1 - rows_real / max(rows_padded, 1),
        prefill_tokens=prefill_real,
        prefill_tokens_padded=prefill_padded,
        decode_kv_tokens_read=decode_kv_tokens,
        prefill_attn_rows_x_keys=attn_rows_keys,
        shapes=[
            dict(
                kind=kind,
                tokens=[1 if k.packed else k.batch, k.tokens],
                block_tables=[k.batch, k.pages],
                q_index=[k.batch, k.query] if k.packed else None,
                steps=n,
            )
            for (kind, k), n in sorted(shapes.items(), key=lambda kv: str(kv[0]))
        ],
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--min-input", type=int, default=100)
    ap.add_argument("--max-input", type=int, default=1024)
    ap.add_argument("--min-output", type=int, default=100)
    ap.add_argument("--max-output", type=int, default=1024)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--num-pages", type=int, default=36004, help="KV pool (36004: Qwen3-8B, H200)")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument(
        "--batch-buckets",
        type=int,
        nargs="+",
        default=(),
        help="decode batch buckets (KernelConfig.batch_buckets; default: the engine's)",
    )
    ap.add_argument("--json", default=None)
    ap.add_argument(
        "--weight-gb",
        type=float,
        default=15.1,
        help="weight bytes read per step, GB (15.1: Qwen3-8B bf16 without the "
        "embedding); 0: print no time floors",
    )
    ap.add_argument("--kv-bytes-per-token", type=int, default=147456)
    ap.add_argument("--params-b", type=float, default=8.0, help="GEMM parameters, billions")
    ap.add_argument("--hbm-tbps", type=float, default=4.27, help="measured copy bandwidth")
    ap.add_argument("--tflops", type=float, default=990.0, help="dense bf16 peak")
    args = ap.parse_args()
    for name in (
        "num_requests",
        "min_input",
        "min_output",
        "vocab",
        "page_size",
        "max_num_seqs",
        "max_num_batched_tokens",
    ):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.num_pages < 2:
        ap.error("--num-pages must be >= 2 (page 0 is the reserved null page)")
    if args.seed < 0:
        ap.error("--seed must be >= 0")
    for name in ("hbm_tbps", "tflops", "kv_bytes_per_token", "params_b"):
        if getattr(args, name) <= 0:
            ap.error(f"--{name.replace('_', '-')} must be > 0")
    if args.weight_gb < 0:
        ap.error("--weight-gb must be >= 0 (0: print no time floors)")
    if args.page_size & (args.page_size - 1):
        ap.error(f"--page-size {args.page_size} must be a power of two (as the engine requires)")
    bb = args.batch_buckets
    if bb and (any(b < 1 for b in bb) or list(bb) != sorted(set(bb)) or bb[-1] < args.max_num_seqs):
        ap.error(
            f"--batch-buckets {' '.join(map(str, bb))}: must be strictly increasing positive "
            f"integers, the largest >= --max-num-seqs ({args.max_num_seqs})"
        )
    if args.min_input > args.max_input or args.min_output > args.max_output:
        ap.error(
            f"--min-input/--max-input ({args.min_input}/{args.max_input}) and --min-output/"
            f"--max-output ({args.min_output}/{args.max_output}): each minimum must be <= its "
            "maximum"
        )

    # the workload of bench_throughput.py (same generator calls, same order)
    rng = np.random.default_rng(args.seed)
    n = args.num_requests
    in_lens = rng.integers(args.min_input, args.max_input + 1, n)
    out_lens = [int(x) for x in rng.integers(args.min_output, args.max_output + 1, n)]
    prompts = [rng.integers(0, min(args.vocab, 10000), int(k)).tolist() for k in in_lens]
    max_model_len = args.max_input + args.max_output
    buckets = BucketSpec.build(
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=max_model_len,
        page_size=args.page_size,
        batch_buckets=tuple(args.batch_buckets),
    )
    try:
        res = simulate(
            prompts,
            out_lens,
            num_pages=args.num_pages,
            page_size=args.page_size,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_model_len=max_model_len,
            buckets=buckets,
        )
    except ValueError as e:  # a request the pool or the buckets cannot hold
        ap.error(str(e))
    print(
        f"steps: {res['steps']}; distinct step shapes: {res['num_shapes']}; decode rows that are "
        f"padding: {res['decode_row_padding']:.1%}"
    )
    print(
        f"prefill tokens {res['prefill_tokens']} (padded to {res['prefill_tokens_padded']}); "
        f"KV tokens read by decode steps {res['decode_kv_tokens_read']}; prefill R*Tq*S "
        f"{res['prefill_attn_rows_x_keys']:.3e}"
    )
    if args.weight_gb:
        # bandwidth floor of decode (weights once per step + KV) and compute floor of prefill GEMMs
        dec = (
            res["steps"].get("decode", 0) * args.weight_gb * 1e9
            + res["decode_kv_tokens_read"] * args.kv_bytes_per_token
        ) / (args.hbm_tbps * 1e12)
        pre = res["prefill_tokens_padded"] * 2 * args.params_b * 1e9 / (args.tflops * 1e12)
        print(
            f"floors at {args.hbm_tbps} TB/s and {args.tflops} TFLOP/s: decode {dec:.2f} s, prefill "
            f"GEMMs {pre:.2f} s (attention, sampling and host time not included)"
        )
    print(f"{'kind':<8} {'tokens':>12} {'tables':>12} {'q_index':>12} {'steps':>6}")
    for s in res["shapes"]:
        print(
            f"{s['kind']:<8} {str(s['tokens']):>12} {str(s['block_tables']):>12} "
            f"{str(s['q_index']):>12} {s['steps']:>6}"
        )
    if args.json:
        try:
            with open(args.json, "w") as fh:
                json.dump(dict(vars(args), **res), fh, indent=1)
        except OSError as e:
            ap.error(f"--json {args.json}: {e.strerror}")


if __name__ == "__main__":
    main()
