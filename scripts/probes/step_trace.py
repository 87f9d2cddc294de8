"""Probe: a timeline of an engine's steps, one JSON line per `LLMEngine.step` call, and its summary.

`StepTrace(llm.engine, path)` wraps the engine's ``step`` (an instance attribute; a probe, not
engine code) and appends per call: ``t0``/``t1`` (perf_counter seconds around the call), the
``shape`` of the step it launched (its `StepShape`: forward [T, decode], sampler [rows, level],
prompt P; None: none launched), its ``rows`` and ``tokens`` (0: none), ``prefill`` (a row of more
than one token), ``lazy`` (programs compiled inside a step so far) and ``steps`` (`EngineStats`
counters), ``running``/``waiting``. Unlike `scripts.step_tools.record_steps` (a timeline of
read-backs), it also shows the time a caller spends between calls (the server's core loop) and
the steps that stalled on a compile.
`mark(label)` writes ``{"mark": label, "t": ...}`` between phases (offline, server); other
processes write theirs to ``path + ".marks"`` (perf_counter is the system's monotonic clock).

    python scripts/probes/step_trace.py TRACE.jsonl   # per phase: steps, busy and idle seconds,
                                                      # step-time percentiles, the longest calls
"""

import json
import os
import sys
import time

import numpy as np


def shape_of(shape) -> list:
    """A `StepShape` as JSON: [[T, decode], [rows, level], P]."""
    f, s = shape.forward, shape.sampler
    return [[f.tokens, f.decode], [s.rows, s.level], shape.prompt]


class StepTrace:
    """Wraps ``engine.step``, one JSON line per call into ``path`` (see the module docstring)."""

    def __init__(self, engine, path: str) -> None:
        self.engine, self.inner, self.f = engine, engine.step, open(path, "a", buffering=1 << 16)
        engine.step = self

    def mark(self, label: str) -> None:
        self.f.write(json.dumps({"mark": label, "t": time.perf_counter()}) + "\n")
        self.f.flush()

    def __call__(self, *args, **kwargs):
        t0 = time.perf_counter()
        out = self.inner(*args, **kwargs)
        t1, eng = time.perf_counter(), self.engine
        fl, st = eng.loop.in_flight, eng._stats
        b = fl.batch if fl is not None else None
        self.f.write(
            json.dumps(
                dict(
                    t0=t0,
                    t1=t1,
                    shape=shape_of(fl.hb.shape) if fl else None,
                    rows=len(b.seqs) if b else 0,
                    tokens=sum(b.num_new_tokens) if b else 0,
                    prefill=bool(b and max(b.num_new_tokens) > 1),
                    lazy=st.num_lazy_compiles,
                    steps=st.num_steps,
                    running=eng.scheduler.num_running,
                    waiting=eng.scheduler.num_waiting,
                )
            )
            + "\n"
        )
        if st.num_steps % 256 == 0:
            self.f.flush()
        return out


def summarize(path: str) -> None:
    phases, label, rows = {}, "start", [json.loads(line) for line in open(path)]
    if os.path.exists(path + ".marks"):  # marks written by another process (bench_serving.py)
        rows = sorted(
            rows + [json.loads(line) for line in open(path + ".marks")],
            key=lambda r: r.get("t", r.get("t0")),
        )
    for r in rows:
        if "mark" in r:
            label = r["mark"]
            continue
        phases.setdefault(label, []).append(r)
    for label, rs in phases.items():
        t0, t1 = np.array([r["t0"] for r in rs]), np.array([r["t1"] for r in rs])
        dt, idle = t1 - t0, np.append(t0[1:] - t1[:-1], 0.0)  # the last call: none after
        print(
            f"{label}: {len(rs)} calls over {t1[-1] - t0[0]:.2f} s; in step {dt.sum():.2f} s, "
            f"between {idle.sum():.2f} s (p50 {np.median(idle) * 1e3:.2f} ms, max "
            f"{idle.max() * 1e3:.1f} ms); step p50/p90/p99/max "
            + "/".join(f"{np.percentile(dt, q) * 1e3:.1f}" for q in (50, 90, 99, 100))
            + " ms; "
            f"rows mean {np.mean([r['rows'] for r in rs]):.0f}, tokens sum "
            f"{sum(r['tokens'] for r in rs)}; lazy compiles {rs[-1]['lazy'] - rs[0]['lazy']}"
        )
        for i in np.argsort(-dt)[:8]:
            r = rs[i]
            print(
                f"   {dt[i] * 1e3:8.1f} ms at +{r['t0'] - t0[0]:6.2f} s shape {r['shape']} rows "
                f"{r['rows']} tokens {r['tokens']} prefill {r['prefill']} lazy {r['lazy']} "
                f"running {r['running']} waiting {r['waiting']}"
            )


if __name__ == "__main__":
    if len(sys.argv) != 2 or sys.argv[1] in ("-h", "--help"):
        print(__doc__)
        sys.exit(0 if sys.argv[1:2] in (["-h"], ["--help"]) else 2)
    summarize(sys.argv[1])
