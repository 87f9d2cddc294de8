"""Host overhead of the engine loop: device idle time between consecutive decode steps.

Runs `LLMEngine` on the Qwen3-8B architecture (random bf16 weights, ``--layers`` of them) with
``--batch`` requests of ``--context`` tokens in steady decode, and compares, in one run:

  device   the engine's compiled decode step (its forward, then its sampler: the executables
           the engine compiled) called back to back on the packed inputs of its last decode step,
           sent once (no host work between steps): the device time of one step
  async    ``LLMEngine.step()`` wall time per step with asynchronous scheduling (step n+1 is
           dispatched before step n's tokens are read back)
  sync     the same with ``async_scheduling=False`` (host work between steps idles the device)

Idle fraction = 1 - device / engine step time. Appends JSON objects (bench="host_overhead") to
``--out``.

``--kernels SPEC``: the engine's kernel config (`KernelConfig.parse`; default: the engine's).

    python scripts/bench_host_overhead.py [--layers 36] [--batch 64] [--context 1024] [--steps 50]
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

from scripts.run_info import git_commit, xla_flags  # noqa: E402


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, default=1024, help="KV length reached at the end")
    ap.add_argument("--steps", type=int, default=50, help="timed steps per mode")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument(
        "--kernels",
        default="",
        metavar="SPEC",
        help="the engine's kernel config (KernelConfig.parse, resolved by the engine); "
        "'' = the default",
    )
    ap.add_argument("--out", default="benchmarks/h200.jsonl")
    return ap


def build_engine(args, cfg, kernels, gen: int):
    """An `LLMEngine` of ``args.batch`` requests of ``args.context - gen`` prompt tokens, each
    to generate ``gen``, over random bf16 weights; its pool holds exactly their pages."""
    import jax
    import jax.numpy as jnp

    from jaxinfer import models
    from jaxinfer.config import EngineConfig, resolve
    from jaxinfer.engine.llm_engine import LLMEngine
    from jaxinfer.runner.model_runner import ModelRunner
    from jaxinfer.sampling_params import SamplingParams

    params = models.init_params(cfg, jax.random.key(0), jnp.bfloat16)
    B, ps, prompt_len = args.batch, args.page_size, args.context - gen
    ec = EngineConfig(
        max_model_len=args.context,
        page_size=ps,
        num_pages=B * -(-args.context // ps) + 1,
        max_num_seqs=B,
        max_num_batched_tokens=token_budget(args),
        dtype="bfloat16",
        kernels=kernels,
    )
    eng = LLMEngine(ModelRunner(cfg, params, resolve(cfg, ec, jax.default_backend())))
    rng = np.random.default_rng(0)
    for _ in range(B):
        eng.add_request(
            rng.integers(0, min(10000, cfg.vocab_size), prompt_len).tolist(),
            SamplingParams(temperature=0.0, max_tokens=gen, ignore_eos=True),
        )
    return eng


def generated_tokens(args, warm: int) -> int:
    """Tokens each request generates: the timed and warm-up steps, plus one per step that
    prefill can take (the scheduler mixes prefill chunks into decode steps, so the first requests
    decode while the last prefill, and must not finish before every row decodes). SystemExit:
    no room left for a prompt in ``--context``."""
    prefill_steps = -(-args.batch * args.context // token_budget(args))
    gen = warm + 2 * args.steps + 2 + prefill_steps
    if gen >= args.context:
        sys.exit(
            f"--context {args.context} leaves no prompt: the run generates {gen} tokens a request "
            f"({prefill_steps} steps of prefill at most, {warm} warm-up, 2 x --steps); raise it"
        )
    return gen


def token_budget(args) -> int:
    """The engine's ``max_num_batched_tokens`` here: 2,048 (or the whole context, if longer)."""
    return max(2048, args.context)


def capture_decode_batches(captured: dict) -> None:
    """Keep the last decode-only `HostBatch` the engine builds in ``captured["hb"]``."""
    import jaxinfer.engine.llm_engine as le

    build = le.build_host_batch

    def capture(batch, **kw):
        hb = build(batch, **kw)
        if max(batch.num_new_tokens) == 1:  # decode rows only
            captured["hb"] = hb
        return hb

    le.build_host_batch = capture


def engine_step_time(eng, steps: int, async_scheduling: bool, calls: dict) -> tuple:
    """(mean wall seconds of `LLMEngine.step`, {call: mean host seconds a step inside it}) over
    ``steps`` steps after one untimed; ``calls``: `time_calls`' running totals."""
    eng.async_scheduling = async_scheduling
    eng.step()
    calls.update(dict.fromkeys(calls, 0.0))
    t = time.perf_counter()
    for _ in range(steps):
        eng.step()
    return (time.perf_counter() - t) / steps, {k: v / steps for k, v in calls.items()}


def time_calls(runner, names=("forward", "sample")) -> dict:
    """Wrap ``runner``'s methods ``names`` (the step's dispatches: the host time spent inside
    the executables' calls, a wait for the device included) to add their wall seconds to the
    returned dict's entries."""
    totals = dict.fromkeys(names, 0.0)
    for name in names:
        method = getattr(runner, name)

        def timed(*a, _m=method, _n=name, **kw):
            t = time.perf_counter()
            try:
                return _m(*a, **kw)
            finally:
                totals[_n] += time.perf_counter() - t

        setattr(runner, name, timed)
    return totals


def device_step_time(eng, hb, steps: int) -> float:
    """Seconds per step of the engine's own forward and sampler executables (`StepExecutor`)
    of ``hb``'s shape run back to back on ``hb``'s inputs, sent once (KV donated)."""
    from jaxinfer.step_input import pack
    from scripts.decode_step import time_steps

    ex, runner = eng.runner.executor, eng.runner
    fwd = ex.executables[("forward", hb.shape.forward)]
    smp = ex.executables[("sampler", hb.shape.sampler)]
    fbuf, sbuf = ex.put(pack(hb, "forward")), ex.put(pack(hb, "sampling"))

    def run(kv):
        (logits, _), kv = fwd(runner.params, kv, fbuf, ex.no_prev_tokens)
        return smp(logits, sbuf), kv

    dt, runner.kv = time_steps(run, runner.kv, steps)
    return dt


def main() -> None:
    ap = parser()
    args = ap.parse_args()
    from jaxinfer.config import KernelConfig, ModelConfig
    from scripts.decode_step import QWEN3_8B

    cfg = ModelConfig(**dict(QWEN3_8B, num_layers=args.layers))
    try:
        kernels = KernelConfig.parse(args.kernels)
    except ValueError as e:
        ap.error(str(e))
    B, warm = args.batch, 8
    eng = build_engine(args, cfg, kernels, generated_tokens(args, warm))
    captured: dict = {}
    capture_decode_batches(captured)
    while eng.scheduler.num_waiting or eng.scheduler.prefilling is not None:
        eng.step()
    for _ in range(warm):  # compile and warm the decode bucket
        eng.step()
    calls = time_calls(eng.runner)
    timed = {m: engine_step_time(eng, args.steps, m == "async", calls) for m in ("async", "sync")}
    hb = captured["hb"]
    fwd = hb.shape.forward
    assert (fwd.tokens, fwd.decode) == (B, True), hb.shape
    timed = {"device": (device_step_time(eng, hb, args.steps), {}), **timed}
    report(args, eng, timed)


def report(args, eng, timed: dict) -> None:
    """Append the rows (one a mode: ms a step, idle fraction, host ms inside each dispatch) to
    ``--out`` and print the table."""
    import jax

    meta = dict(
        bench="host_overhead",
        layers=args.layers,
        B=args.batch,
        context=args.context,
        kernels=args.kernels,
        attention=eng.resolved.kernels.decode_attention,
        compiles=eng.stats().num_compiles,
        jax=jax.__version__,
        device=jax.devices()[0].device_kind,
        date=datetime.date.today().isoformat(),
        commit=git_commit(),
        xla_flags=xla_flags(),
    )
    t_dev = timed["device"][0]
    rows = [
        dict(
            meta,
            mode=m,
            ms_per_step=t * 1e3,
            idle_frac=max(0.0, 1 - t_dev / t),
            **{f"{k}_call_ms": v * 1e3 for k, v in calls.items()},
        )
        for m, (t, calls) in timed.items()
    ]
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "a") as fh:
        fh.writelines(json.dumps(r) + "\n" for r in rows)
    print(
        f"\nB={args.batch} context={args.context} layers={args.layers} "
        f"attention={meta['attention']} compiles={meta['compiles']}"
    )
    print(f"{'mode':<8} {'ms/step':>8} {'idle':>6} {'forward call':>13} {'sample call':>12}")
    for r in rows:
        f, smp = (r.get(f"{k}_call_ms", float("nan")) for k in ("forward", "sample"))
        head = f"{r['mode']:<8} {r['ms_per_step']:>8.2f} {r['idle_frac']:>6.1%}"
        print(f"{head} {f:>13.2f} {smp:>12.2f}")


if __name__ == "__main__":
    main()
