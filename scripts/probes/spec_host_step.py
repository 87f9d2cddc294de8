"""Host work of one engine step on the tiny model (CPU): speculative (k drafts) and plain decoding.

Per mode, one request set runs untimed (compiles), then ``--reps`` timed runs; each step of the
decode phase (after the last prompt chunk) is timed around `LLMEngine.step`, and the host calls
inside it are timed by wrappers (`COMPONENTS`): schedule (the proposer inside it), the proposer,
build_host_batch, the forward and sampler dispatches, read (its wait for the device included),
wait (that wait alone: ``jax.block_until_ready`` on the step's outputs), postprocess, the verify
step's bookkeeping (`_emitted`) and the outputs. Host ms a step = step - wait. ``device``: the
step's forward and sampler executables run back to back on its last decode (or verify) step's
inputs, sent once, each step awaited. The run of median ms a step of ``--reps`` is printed.

Modes: ``plain1`` (B = 1), ``ngram1`` and ``oracle1`` (B = 1, k = ``--k``, the n-gram proposer
and `scripts/bench_spec.py`'s `Oracle` at ``--rate``), ``plain64`` (B = 64). ``--profile
MODE``: cProfile of that mode's timed decode steps (top ``--top`` by own time).

    python scripts/probes/spec_host_step.py [--modes plain1,ngram1,oracle1,plain64]
        [--tokens 400] [--reps 3] [--k 4] [--rate 0.8] [--profile ngram1]
"""

import argparse
import cProfile
import os
import pstats
import statistics
import sys
import time
from argparse import Namespace

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from scripts import bench_spec  # noqa: E402

COMPONENTS = (  # (owner attribute path from the engine, method name, label)
    ("scheduler", "schedule", "schedule"),
    ("speculation", "proposer", "proposer"),
    ("runner", "forward", "forward"),
    ("runner", "sample", "sample"),
    ("runner", "read", "read"),
    ("scheduler", "postprocess", "postprocess"),
    ("", "_emitted", "emitted"),
    ("outputs", "outputs", "outputs"),
)


def device_time(eng, hb, steps: int) -> float:
    """Seconds a step of the engine's forward and sampler executables of ``hb``'s shape run
    back to back on ``hb``'s inputs, sent once (KV donated), each step's outputs awaited."""
    from jaxinfer.step_input import pack

    ex, runner = eng.runner.executor, eng.runner
    fwd = ex.executables[("forward", hb.shape.forward)]
    smp = ex.executables[("sampler", hb.shape.sampler)]
    fbuf, sbuf = ex.put(pack(hb, "forward")), ex.put(pack(hb, "sampling"))
    kv, t = runner.kv, 0.0
    for i in range(steps + 3):
        t0 = time.perf_counter()
        (logits, _), kv = fwd(runner.params, kv, fbuf, ex.no_prev_tokens)
        jax.block_until_ready(smp(logits, sbuf))
        t += (time.perf_counter() - t0) * (i >= 3)
    runner.kv = kv
    return t / steps


def wrap(eng, totals: dict) -> None:
    """Wrap `COMPONENTS` and the engine module's ``build_host_batch`` to add wall seconds to
    ``totals`` and keep the last decode-only `HostBatch` in ``totals["hb"]``."""
    import jaxinfer.engine.llm_engine as le

    def timed(fn, label):
        def call(*a, **kw):
            t = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                totals[label] = totals.get(label, 0.0) + time.perf_counter() - t

        return call

    for owner, name, label in COMPONENTS:
        obj = eng if not owner else getattr(eng, owner)
        if obj:
            setattr(obj, name, timed(getattr(obj, name), label))
    build, spec = le.build_host_batch, bool(eng.speculation)

    def capture(batch, **kw):
        hb = build(batch, **kw)
        if batch.num_draft_tokens or (max(batch.num_new_tokens) == 1 and not spec):
            totals["hb"] = hb
        return hb

    le.build_host_batch = timed(capture, "build_host_batch")
    read = eng.runner.read

    def wait_then_read(handle, prompt=None):
        eng.runner.read_wait((handle, prompt))
        return read(handle, prompt)

    eng.runner.read = timed(wait_then_read, "read")
    eng.runner.read_wait = timed(jax.block_until_ready, "wait")


def decode_steps(eng, prompts, sp, profile=None) -> tuple[list[float], dict, int]:
    """Run ``prompts``: (each decode step's wall seconds, component seconds over them, tokens).
    SystemExit: outputs other than ``eng.probe_refs`` (when set)."""
    index = {eng.add_request(p, sp): i for i, p in enumerate(prompts)}
    outs = [None] * len(prompts)
    while eng.scheduler.waiting or eng.scheduler.prefilling is not None:
        for o in eng.step():
            outs[index[o.request_id]] = list(o.outputs[0].token_ids)
    made = sum(s.num_output_tokens for s in eng.scheduler.running)
    totals, walls, tokens = eng.probe_totals, [], 0
    totals.update(dict.fromkeys([k for k in totals if k != "hb"], 0.0))
    while eng.has_unfinished():
        if profile is not None:
            profile.enable()
        t = time.perf_counter()
        done = eng.step()
        walls.append(time.perf_counter() - t)
        if profile is not None:
            profile.disable()
        for o in done:
            outs[index[o.request_id]] = list(o.outputs[0].token_ids)
            tokens += len(o.outputs[0].token_ids)
    if getattr(eng, "probe_refs", None) not in (None, outs):
        raise SystemExit("outputs differ from plain greedy")
    return walls, {k: v for k, v in totals.items() if k != "hb"}, tokens - made


def build(args, mode: str, plain_refs=None):
    """(LLM, prompts, SamplingParams) of ``mode``; a B = 1 mode checks its outputs against
    ``plain_refs`` (None: not checked)."""
    from jaxinfer import LLM

    B = 64 if mode == "plain64" else 1
    ns = Namespace(tiny=True, layers=2, batches=str(B), context=32, tokens=args.tokens, kernels="")
    cfg, params, eng = bench_spec.build_model(ns)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, cfg.vocab_size, 32).tolist() for _ in range(B)]
    spec = None if mode.startswith("plain") else dict(method="ngram", num_speculative_tokens=args.k)
    llm = LLM.from_params(cfg, params, speculative_config=spec, **eng)
    if mode == "oracle1":
        oracle = bench_spec.Oracle(prompts, plain_refs, args.rate, cfg.vocab_size)
        llm.engine.speculation.proposer = oracle
    llm.engine.probe_totals, llm.engine.probe_refs = {}, plain_refs if B == 1 else None
    wrap(llm.engine, llm.engine.probe_totals)
    return llm, prompts, bench_spec.greedy(args.tokens)


def measure(args, mode: str, refs) -> dict:
    """One mode: the run of median ms a step of ``args.reps``: its ms a step and component ms
    a step; the device ms a step."""
    llm, prompts, sp = build(args, mode, refs)
    eng = llm.engine
    decode_steps(eng, prompts, sp)  # compiles
    prof = cProfile.Profile() if args.profile == mode else None
    reps = []
    for _ in range(args.reps):
        walls, comps, toks = decode_steps(eng, prompts, sp, prof)
        reps.append((statistics.mean(walls), {k: v / len(walls) for k, v in comps.items()}))
        reps[-1][1]["tokens_per_step"] = toks / len(walls)
    step, comps = sorted(reps, key=lambda r: r[0])[len(reps) // 2]
    hb = eng.probe_totals["hb"]
    dev = min(device_time(eng, hb, 100) for _ in range(3))
    if prof is not None:
        pstats.Stats(prof).sort_stats("tottime").print_stats(args.top)
    return dict(mode=mode, step_ms=step * 1e3, device_ms=dev * 1e3, comps=comps)


def report(r: dict) -> None:
    c = r["comps"]
    host = r["step_ms"] - c["wait"] * 1e3
    print(
        f"{r['mode']:<8} step {r['step_ms']:.3f} ms  wait {c['wait'] * 1e3:.3f} ms  host "
        f"{host:.3f} ms  device {r['device_ms']:.3f} ms  tokens/step {c.pop('tokens_per_step'):.2f}"
    )
    print("   " + "  ".join(f"{k} {v * 1e3:.3f}" for k, v in c.items()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--modes", default="plain1,ngram1,oracle1,plain64")
    ap.add_argument("--tokens", type=int, default=400)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--rate", type=float, default=0.8)
    ap.add_argument("--profile", default="")
    ap.add_argument("--top", type=int, default=30)
    args = ap.parse_args()
    modes = args.modes.split(",")
    refs = reference(args) if {"ngram1", "oracle1"} & set(modes) else None
    for mode in modes:
        report(measure(args, mode, refs))


def reference(args) -> list[list[int]]:
    """Plain greedy outputs of the B = 1 prompt (the oracle's reference)."""
    llm, prompts, sp = build(args, "plain1")
    outs = llm.generate([dict(prompt_token_ids=p) for p in prompts], sp, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


if __name__ == "__main__":
    main()
