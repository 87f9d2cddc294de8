"""Sleep and wake for RL (vLLM's ``LLM.sleep`` / ``wake_up``): device memory each level frees,
seconds of ``sleep`` and ``wake_up``, and whether generation after waking equals generation
before (greedy token ids).

Random-weight Qwen3-8B architecture (``--layers``, bf16 on a GPU; ``--tiny``: bench_serving's
tiny one in float32, a CPU check). Per level: generate, sleep, wake_up (level 2: then
`update_params` with a host copy of the weights, as a trainer hands them over), generate again.
Device bytes in use come from the XLA allocator (None on the CPU). A table, one JSON line per
level (bench="sleep") in ``--out``.

    python scripts/bench_sleep.py [--layers 36] [--tiny] [--out benchmarks/h200.jsonl]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from scripts.bench_serving import TINY_HF  # noqa: E402
from scripts.bench_throughput import QWEN3_8B_HF  # noqa: E402
from scripts.run_info import git_commit, xla_flags  # noqa: E402


def parse_args():
    """The command line (see the module docstring)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--out", default="benchmarks/h200.jsonl")
    return ap.parse_args()


def build_llm(args):
    """``(llm, cfg, dtype)``: the random-weight model (``--tiny``: bench_serving's tiny one with 2
    layers in float32; else Qwen3-8B's architecture with ``--layers`` in bfloat16) in an engine
    of 512 tokens and 8 sequences."""
    import jax
    import jax.numpy as jnp

    from jaxinfer import LLM, models
    from jaxinfer.config import ModelConfig

    hf = dict(
        TINY_HF if args.tiny else QWEN3_8B_HF,
        model_type="qwen3",
        num_hidden_layers=2 if args.tiny else args.layers,
    )
    cfg = ModelConfig.from_hf_config(hf)
    dtype = "float32" if args.tiny else "bfloat16"
    llm = LLM.from_params(
        cfg,
        models.init_params(cfg, jax.random.key(0), jnp.dtype(dtype)),
        max_model_len=512,
        max_num_seqs=8,
    )
    return llm, cfg, dtype


def sleep_level(llm, level, in_use) -> tuple[float, float, int | None, int | None]:
    """``(sleep_s, wake_s, bytes_awake, bytes_asleep)`` of one sleep at ``level`` and the wake-up
    after it (level 2: with `update_params` from a host copy of the weights taken before), timed
    until the weights are ready; ``in_use()`` reads the device bytes in use."""
    import jax
    import numpy as np

    host = None if level == 1 else jax.tree.map(np.array, llm.engine.runner.params)
    awake, t0 = in_use(), time.perf_counter()
    llm.sleep(level)
    t_sleep, asleep, t1 = time.perf_counter() - t0, in_use(), time.perf_counter()
    llm.wake_up()
    if host is not None:
        llm.update_params(host)
    jax.block_until_ready(llm.engine.runner.params)
    t_wake = time.perf_counter() - t1
    return t_sleep, t_wake, awake, asleep


def print_level(r) -> None:
    """One line for a level's row: bytes freed, seconds of sleep and wake-up, same tokens."""
    level = r["level"]
    freed = "n/a" if r["freed_gib"] is None else f"{r['freed_gib']:.1f} GiB"
    print(
        f"level {level}: freed {freed}, sleep {r['sleep_s']:.2f} s, wake_up"
        f"{' + update_params' * (level == 2)} {r['wake_s']:.2f} s, same tokens after: "
        f"{r['same_tokens']}",
        flush=True,
    )


def main() -> None:
    args = parse_args()
    import jax
    import numpy as np

    from jaxinfer import SamplingParams
    from scripts.plan_memory import device_memory_stats

    llm, cfg, dtype = build_llm(args)
    rng = np.random.default_rng(0)
    reqs = [{"prompt_token_ids": rng.integers(0, cfg.vocab_size, 64).tolist()} for _ in range(8)]
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)

    def run() -> list:
        return [list(o.outputs[0].token_ids) for o in llm.generate(reqs, greedy)]

    def in_use() -> int | None:
        return (device_memory_stats() or (None,))[0]

    before, rows = run(), []
    for level in (1, 2):
        t_sleep, t_wake, awake, asleep = sleep_level(llm, level, in_use)
        rows.append(
            dict(
                bench="sleep",
                level=level,
                layers=cfg.num_layers,
                dtype=dtype,
                device=str(jax.devices()[0].device_kind),
                bytes_awake=awake,
                bytes_asleep=asleep,
                freed_gib=None if awake is None else (awake - asleep) / 2**30,
                sleep_s=t_sleep,
                wake_s=t_wake,
                same_tokens=run() == before,
                date=datetime.date.today().isoformat(),
                commit=git_commit(),
                xla_flags=xla_flags(),
            )
        )
        print_level(rows[-1])
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "a") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)


if __name__ == "__main__":
    main()
