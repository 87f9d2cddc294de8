"""The step shapes of a configuration, host only: the whole planned set, and a workload's dry run.

First the planned set (`BucketSpec.planned`: every program compiled before serving) as a table:
the forwards (decode at each row bucket, ragged at each token bucket) and the samplers (each row
count the forwards produce, at each level of `jaxinfer.step_input.LEVELS`), with their counts.
Prompt scorers, the samplers of logits processors and of a wider logit bias compile on first use
and are not in it (docs/step.md).

Then, unless ``--no-workload``, the throughput workload runs through the scheduler and the batch
builder in the engine's step order (`jaxinfer.engine.dry_run`: no JAX, no model): its steps
(decode-only or ragged), their padding, and the `StepShape`s it visits with their step counts
and whether each is planned. The workload is bench_throughput.py's (same seed and ranges);
sampled tokens are a constant (ignore_eos). Also prints the bandwidth floor of the steps (each
reads the weights once, plus the KV it attends) and the compute floor of their GEMMs for a model
of ``--weight-gb`` / ``--params-b`` (defaults: Qwen3-8B on the H200), a bound, not a measurement.

    python scripts/plan_step_shapes.py [--max-num-seqs 256] [--max-num-batched-tokens 8192]
        [--max-model-len 2048] [--vocab 151936] [--batch-buckets B ...] [--token-buckets T ...]
        [--num-pages 36004] [--no-workload] [--json FILE]
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
from jaxinfer.step_input import LEVELS, BucketSpec, rows_of  # noqa: E402


def planned_set(buckets: BucketSpec) -> dict:
    """`BucketSpec.planned` in numbers: ``forwards`` and ``samplers`` (counts), ``decode_rows``
    and ``ragged_tokens`` (the forwards' sizes), ``sampler_rows`` and ``levels`` (the samplers:
    each row count at each level; ``full_bias``: the full level's bias entries per row)."""
    planned = buckets.planned()
    fwd, smp = planned["forward"], planned["sampler"]
    levels = {lv: [k.rows for k in smp if k.level == lv and not k.spec] for lv in LEVELS}
    assert all(rows == buckets.sampler_rows() for rows in levels.values())
    return dict(
        forwards=len(fwd),
        decode_rows=[k.tokens for k in fwd if k.decode],
        ragged_tokens=[k.tokens for k in fwd if not k.decode and not k.spec],
        verify_tokens=[k.tokens for k in fwd if k.spec],
        verify_samplers=len([k for k in smp if k.spec]) // len(LEVELS),
        samplers=len(smp),
        sampler_rows=buckets.sampler_rows(),
        levels=list(LEVELS),
        full_bias=max(k.bias for k in smp),
    )


def print_planned(p: dict, max_rows: int) -> None:
    nd, nr, nrows = len(p["decode_rows"]), len(p["ragged_tokens"]), len(p["sampler_rows"])
    print(
        f"planned set: {p['forwards']} forwards ({nd} decode, {nr} ragged) and {p['samplers']} "
        f"samplers ({nrows} row counts x {len(p['levels'])} levels): "
        f"{p['forwards'] + p['samplers']} programs"
    )
    join = lambda xs: " ".join(map(str, xs))  # noqa: E731
    print(f"{'program':<8} {'kind':<14} {'count':>5}  sizes")
    print(f"{'forward':<8} {'decode rows':<14} {nd:>5}  {join(p['decode_rows'])}")
    print(
        f"{'forward':<8} {'ragged tokens':<14} {nr:>5}  {join(p['ragged_tokens'])} "
        f"(rows min(T, {max_rows}))"
    )
    for lv in p["levels"]:
        bias = f" (bias {p['full_bias']} entries per row)" if lv == "full" else ""
        print(f"{'sampler':<8} {lv + ' rows':<14} {nrows:>5}  {join(p['sampler_rows'])}{bias}")
    if nv := len(p["verify_tokens"]):
        print(f"{'forward':<8} {'verify tokens':<14} {nv:>5}  {join(p['verify_tokens'])}")
        print(f"{'sampler':<8} {'verify rows':<14} {p['verify_samplers']:>5}  (x 3 levels)")
    print(
        "not planned (compiled on first use): prompt scorers (T, P), samplers of logits "
        "processors or of a wider logit bias"
    )


def _scheduler(num_pages, page_size, max_num_seqs, max_num_batched_tokens, max_model_len):
    return Scheduler(
        BlockManager(num_pages, page_size),
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        page_size=page_size,
    )


def _count(step, acc: dict) -> None:
    """Add one dry-run step's rows and tokens to ``acc``."""
    batch, hb = step
    fwd = hb.shape.forward
    prompt = [c < s.num_prompt_tokens for s, c in zip(batch.seqs, batch.start_positions)]
    acc["prefill_tokens"] += sum(n for n, p in zip(batch.num_new_tokens, prompt) if p)
    acc["decode_rows"] += prompt.count(False)
    acc["kv_tokens_read"] += int(hb.seq_lens.sum())
    acc["tokens_padded"] += fwd.tokens
    kind = "decode" if fwd.decode else "ragged"
    acc[kind] += 1
    acc[kind + "_real"] += batch.num_seqs if fwd.decode else sum(batch.num_new_tokens)
    acc[kind + "_padded"] += fwd.tokens


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
    """Run the workload to completion in the engine's step order (`jaxinfer.engine.dry_run`):
    steps by kind ("decode": every row one token, else "ragged"), prompt tokens prefilled and
    decode rows run (in any step), padding, KV tokens attended, and each `StepShape` visited
    with its step count and whether `BucketSpec.planned` holds its forward and sampler."""
    sched = _scheduler(num_pages, page_size, max_num_seqs, max_num_batched_tokens, max_model_len)
    requests = [
        (list(p), SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
        for p, n in zip(prompts, out_lens)
    ]
    shapes: collections.Counter = collections.Counter()
    acc: collections.Counter = collections.Counter()
    for step in dry_run(sched, requests, buckets=buckets, async_scheduling=async_scheduling):
        shapes[step[1].shape] += 1
        _count(step, acc)
    planned = buckets.planned()
    return dict(
        steps={k: acc[k] for k in ("decode", "ragged") if acc[k]},
        num_shapes=len(shapes),
        decode_rows=acc["decode_rows"],
        decode_row_padding=1 - acc["decode_real"] / max(acc["decode_padded"], 1),
        prefill_tokens=acc["prefill_tokens"],
        ragged_tokens=acc["ragged_real"],
        ragged_tokens_padded=acc["ragged_padded"],
        tokens_padded=acc["tokens_padded"],
        kv_tokens_read=acc["kv_tokens_read"],
        shapes=[
            dict(
                forward="decode" if s.forward.decode else "ragged",
                tokens=s.forward.tokens,
                rows=rows_of(s.forward, buckets.sizes),
                sampler=s.sampler.level,
                bias=s.sampler.bias,
                prompt=s.prompt,
                steps=n,
                planned=s.forward in planned["forward"] and s.sampler in planned["sampler"],
            )
            for s, n in sorted(shapes.items(), key=lambda kv: (not kv[0].forward.decode, kv[0]))
        ],
    )


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default, text in (
        ("num-requests", 256, None),
        ("min-input", 100, None),
        ("max-input", 1024, None),
        ("min-output", 100, None),
        ("max-output", 1024, None),
        ("seed", 0, None),
        ("vocab", 151936, "vocabulary size (151936: Qwen3-8B)"),
        ("num-pages", 36004, "KV pool (36004: Qwen3-8B, H200)"),
        ("page-size", 16, None),
        ("max-num-seqs", 256, None),
        ("max-num-batched-tokens", 8192, None),
        ("max-model-len", None, "default: --max-input + --max-output"),
        ("num-speculative-tokens", 0, "k of speculative decoding (0: off)"),
        ("disable-by-batch-size", 16, "speculative decoding's decode rows (the engine's default)"),
    ):
        ap.add_argument("--" + name, type=int, default=default, help=text)
    for name, what in (("batch", "decode rows"), ("token", "ragged tokens")):
        ap.add_argument(
            f"--{name}-buckets",
            type=int,
            nargs="+",
            default=(),
            help=f"{what} buckets (KernelConfig.{name}_buckets; default: the engine's)",
        )
    ap.add_argument(
        "--workload",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="dry-run the workload after the planned set (--no-workload: the planned set only)",
    )
    ap.add_argument("--json", default=None)
    ap.add_argument(
        "--weight-gb",
        type=float,
        default=15.1,
        help="weight bytes read per step, GB (15.1: Qwen3-8B bf16 without the embedding); "
        "0: print no time floors",
    )
    ap.add_argument("--kv-bytes-per-token", type=int, default=147456)
    ap.add_argument("--params-b", type=float, default=8.0, help="GEMM parameters, billions")
    ap.add_argument("--hbm-tbps", type=float, default=4.27, help="measured copy bandwidth")
    ap.add_argument("--tflops", type=float, default=990.0, help="dense bf16 peak")
    return ap


def check_args(ap, args) -> None:
    """Exit through ``ap.error`` on a value out of range."""
    for name in ("num_requests", "min_input", "min_output", "vocab", "page_size"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
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
    for flag, bb, limit, least in (
        ("--batch-buckets", args.batch_buckets, "--max-num-seqs", args.max_num_seqs),
        (
            "--token-buckets",
            args.token_buckets,
            "--max-num-batched-tokens",
            args.max_num_batched_tokens,
        ),
    ):
        if bb and (any(b < 1 for b in bb) or list(bb) != sorted(set(bb)) or bb[-1] < least):
            ap.error(
                f"{flag} {' '.join(map(str, bb))}: must be strictly increasing positive "
                f"integers, the largest >= {limit} ({least})"
            )
    if args.min_input > args.max_input or args.min_output > args.max_output:
        ap.error(
            f"--min-input/--max-input ({args.min_input}/{args.max_input}) and --min-output/"
            f"--max-output ({args.min_output}/{args.max_output}): each minimum must be <= its "
            "maximum"
        )


def run_workload(ap, args, buckets: BucketSpec) -> dict:
    """bench_throughput.py's workload (same generator calls, same order) through `simulate`."""
    rng = np.random.default_rng(args.seed)
    n = args.num_requests
    in_lens = rng.integers(args.min_input, args.max_input + 1, n)
    out_lens = [int(x) for x in rng.integers(args.min_output, args.max_output + 1, n)]
    prompts = [rng.integers(0, min(args.vocab, 10000), int(k)).tolist() for k in in_lens]
    try:
        return simulate(
            prompts,
            out_lens,
            num_pages=args.num_pages,
            page_size=args.page_size,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_model_len=args.max_model_len,
            buckets=buckets,
        )
    except ValueError as e:  # a request the pool, the context or the buckets cannot hold
        ap.error(str(e))


def print_workload(res: dict, args) -> None:
    print(
        f"\nworkload: steps {res['steps']}; distinct step shapes {res['num_shapes']} "
        f"({sum(not s['planned'] for s in res['shapes'])} not planned); decode rows "
        f"{res['decode_rows']}, of decode-only steps' rows padding {res['decode_row_padding']:.1%}"
    )
    print(
        f"prompt tokens prefilled {res['prefill_tokens']}; ragged steps' tokens "
        f"{res['ragged_tokens']} (padded to {res['ragged_tokens_padded']}); KV tokens attended "
        f"{res['kv_tokens_read']}"
    )
    if args.weight_gb:
        steps = sum(res["steps"].values())
        mem = steps * args.weight_gb * 1e9 + res["kv_tokens_read"] * args.kv_bytes_per_token
        gemm = res["tokens_padded"] * 2 * args.params_b * 1e9 / (args.tflops * 1e12)
        print(
            f"floors at {args.hbm_tbps} TB/s and {args.tflops} TFLOP/s: bandwidth "
            f"{mem / (args.hbm_tbps * 1e12):.2f} s (weights once per step + KV), GEMMs over the "
            f"padded tokens {gemm:.2f} s (attention, sampling and host time not included)"
        )
    print(
        f"{'forward':<8} {'T':>6} {'R':>5} {'sampler':>8} {'bias':>5} {'P':>5} {'steps':>6} planned"
    )
    for s in res["shapes"]:
        print(
            f"{s['forward']:<8} {s['tokens']:>6} {s['rows']:>5} {s['sampler']:>8} "
            f"{s['bias']:>5} {s['prompt']:>5} {s['steps']:>6} {'yes' if s['planned'] else 'NO'}"
        )


def main() -> None:
    ap = parser()
    args = ap.parse_args()
    if args.max_model_len is None:
        args.max_model_len = args.max_input + args.max_output
    check_args(ap, args)
    buckets = BucketSpec.build(
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        page_size=args.page_size,
        vocab_size=args.vocab,
        batch_buckets=tuple(args.batch_buckets),
        token_buckets=tuple(args.token_buckets),
        spec=args.num_speculative_tokens,
        spec_rows=args.disable_by_batch_size + 1,
    )
    res = dict(planned=planned_set(buckets))
    print_planned(res["planned"], buckets.sizes.max_rows)
    if args.workload:
        res.update(run_workload(ap, args, buckets))
        print_workload(res, args)
    if args.json:
        try:
            with open(args.json, "w") as fh:
                json.dump(dict(vars(args), **res), fh, indent=1)
        except OSError as e:
            ap.error(f"--json {args.json}: {e.strerror}")


if __name__ == "__main__":
    main()
