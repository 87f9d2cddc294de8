"""What benchmarks build around the engine's step, outside the package: a per-step log recorded
through the engine's hooks (`record_steps`, `StepRecord`, `step_phases`, `TracedStepLog`,
`trace_summary`) and the printing of the last two (`print_step_phases`, `print_trace_summary`)."""

from __future__ import annotations

import os
import time
from typing import NamedTuple

import jax


class StepRecord(NamedTuple):
    """One read-back step (``time.perf_counter`` seconds): ``wait_s`` blocked on its tokens,
    the reading step's ``schedule_s``/``launch_s`` (0: read back first) and ``post_s``."""

    shape_key: tuple
    rows: int
    t_done: float
    wait_s: float = 0.0
    schedule_s: float = 0.0
    launch_s: float = 0.0
    post_s: float = 0.0


def record_steps(engine, log: list) -> list:
    """Append a `StepRecord` to ``log`` per step ``engine`` (an `LLMEngine`) reads back, by
    wrapping its step loop's ``complete`` and its runner's ``read``; returns ``log``."""
    complete, read, t = engine.loop.complete, engine.runner.read, {}

    def timed_read(handle, prompt=None):
        t["read"] = time.perf_counter()
        out = read(handle, prompt)
        t["done"] = time.perf_counter()
        return out

    def timed_complete(done, host_times):
        finished = complete(done, host_times)
        log.append(
            StepRecord(
                done.hb.shape,
                done.batch.num_seqs,
                t["done"],
                t["done"] - t["read"],
                *host_times,
                time.perf_counter() - t["done"],
            )
        )
        return finished

    engine.runner.read, engine.loop.complete = timed_read, timed_complete
    return log


def step_phases(log, t0: float) -> dict:
    """Seconds per step kind from a step log (`record_steps`; time between consecutive
    read-backs, the first counted from ``t0``): prefill steps, and decode steps per batch bucket
    with their mean real rows, plus the host's time per step blocked on the device (``wait``)
    and in its own work (``schedule``, ``launch``: build + transfer + dispatch, ``post``). A
    bucket whose wait is near 0 is host-bound: the device finished before the host asked."""
    out: dict = {"prefill": dict(steps=0, seconds=0.0), "decode": {}}
    prev = t0
    keys = ("wait_s", "schedule_s", "launch_s", "post_s")
    for r in log:
        dt, prev = r.t_done - prev, r.t_done
        if not r.shape_key.forward.decode:  # a step with a prefill chunk
            out["prefill"]["steps"] += 1
            out["prefill"]["seconds"] += dt
            continue
        d = out["decode"].setdefault(
            str(r.shape_key.forward.tokens),
            dict(steps=0, seconds=0.0, rows=0, **dict.fromkeys(keys, 0.0)),
        )
        d["steps"] += 1
        d["seconds"] += dt
        d["rows"] += r.rows
        for k in keys:
            d[k] += getattr(r, k)
    for d in out["decode"].values():
        d["ms_per_step"] = d["seconds"] / d["steps"] * 1e3
        d["mean_rows"] = d.pop("rows") / d["steps"]
        for k in keys:
            d[k.replace("_s", "_ms_per_step")] = d.pop(k) / d["steps"] * 1e3
    return out


class TracedStepLog(list):
    """A step log (`record_steps`) that also runs the JAX profiler over a window of steps: the trace
    starts when step ``start`` is read back and stops when step ``start + count`` is (under
    asynchronous scheduling about ``count`` steps of device work lie between)."""

    def __init__(self, start: int, count: int, logdir: str):
        super().__init__()
        self.start, self.count, self.logdir = start, count, logdir
        self.active = False

    def append(self, item) -> None:
        super().append(item)

        if len(self) == self.start:
            jax.profiler.start_trace(self.logdir)
            self.active = True
        elif self.active and len(self) == self.start + self.count:
            jax.profiler.stop_trace()
            self.active = False


def trace_summary(log: TracedStepLog, top: int = 20) -> dict:
    """Kernel time per step in the traced window, the GPU's busy time against the span, and its
    idle gaps (the host not keeping the device fed shows as gaps of tens of µs or more)."""
    import collections
    import glob

    from scripts.profile_decode_step import busy_ns, idle_gaps, kernel_events, short

    if log.active:  # the run ended inside the window
        import jax

        jax.profiler.stop_trace()
        log.active = False
    paths = glob.glob(os.path.join(log.logdir, "**", "*.xplane.pb"), recursive=True)
    window = log[log.start : log.start + log.count]
    n = len(window)
    if not paths or not n:
        return dict(
            error=f"the run had {len(log)} steps: none inside the traced window "
            f"starting at step {log.start}"
        )
    try:
        ev = sorted(kernel_events(paths[0]), key=lambda e: e[1])
    except RuntimeError as e:  # no GPU plane (a CPU run)
        return dict(error=str(e))
    if not ev:
        return dict(error="the trace holds no GPU kernel events")
    span = ev[-1][1] + ev[-1][2] - ev[0][1]
    gaps = idle_gaps(ev)
    agg = collections.defaultdict(lambda: [0, 0])
    for name, _, d in ev:
        agg[short(name)][0] += 1
        agg[short(name)][1] += d
    kernels = sorted(
        (
            {"kernel": k, "launches_per_step": c / n, "us_per_step": t / n / 1e3}
            for k, (c, t) in agg.items()
        ),
        key=lambda r: -r["us_per_step"],
    )[:top]
    big = [g["us"] for g in gaps if g["us"] >= 20]
    return dict(
        steps=n,
        shapes=sorted({str(r.shape_key) for r in window}),
        rows=[r.rows for r in window],
        span_ms_per_step=span / n / 1e6,
        busy_ms_per_step=busy_ns(ev) / n / 1e6,
        launches_per_step=len(ev) / n,
        gaps_over_20us=len(big),
        gap_ms_over_20us=sum(big) / 1e3,
        largest_gaps=sorted(gaps, key=lambda g: -g["us"])[:8],
        kernels=kernels,
    )


def print_step_phases(ph) -> None:
    """Print `step_phases`'s result as bench_throughput.py reports it: jaxinfer's prefill steps
    and seconds, then decode steps and host ms per step by bucket."""
    print(f"\njaxinfer prefill: {ph['prefill']['steps']} steps, {ph['prefill']['seconds']:.2f} s")
    print(
        "decode steps per bucket; host ms per step: blocked on the device (wait), scheduling, "
        "building + dispatching (launch), advancing sequences (post)"
    )
    print(
        f"{'decode B':>9} {'steps':>6} {'s':>7} {'ms/step':>8} {'mean rows':>9} {'wait':>6} "
        f"{'sched':>6} {'launch':>6} {'post':>6}"
    )
    for b, d in sorted(ph["decode"].items(), key=lambda kv: int(kv[0])):
        print(
            f"{b:>9} {d['steps']:>6} {d['seconds']:>7.2f} {d['ms_per_step']:>8.2f} "
            f"{d['mean_rows']:>9.1f} {d['wait_ms_per_step']:>6.2f} "
            f"{d['schedule_ms_per_step']:>6.2f} {d['launch_ms_per_step']:>6.2f} "
            f"{d['post_ms_per_step']:>6.2f}"
        )


def print_trace_summary(tr, trace_steps) -> None:
    """Print `trace_summary`'s result ``tr`` of steps ``trace_steps`` (START, COUNT), nothing when
    ``tr`` is None: its error, or its span, busy time, launches, largest idle gaps and kernels."""
    if tr and "error" in tr:
        print(f"\ntraced steps {trace_steps}: {tr['error']}")
    elif tr:
        print(f"\ntraced steps {trace_steps}: shapes {tr['shapes']}, rows {tr['rows']}")
        print(
            f"span {tr['span_ms_per_step']:.3f} ms/step, GPU busy {tr['busy_ms_per_step']:.3f} "
            f"ms/step, {tr['launches_per_step']:.0f} launches/step; {tr['gaps_over_20us']} "
            f"gaps >= 20 us ({tr['gap_ms_over_20us']:.2f} ms); largest:"
        )
        for g in tr["largest_gaps"]:
            print(f"  {g['us']:>9.1f} us  {g['before'][:50]} -> {g['after'][:50]}")
        for k in tr["kernels"]:
            print(f"  {k['kernel']:<80} {k['launches_per_step']:>6.1f} {k['us_per_step']:>9.1f} us")
