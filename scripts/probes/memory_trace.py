"""Probe: weights / KV pool / pages in use / other device bytes over a generate run, as CSV.

Runs the ``python -m jaxinfer.generate`` CLI with the engine's `MemoryTracker` snapshotting after
every step (one row before generation), writes the rows to FILE under `CSV_HEADER` and prints the
last one as a line on stderr (`report`). ``other_bytes``: device bytes in use - weights - KV pool,
0 where the device reports no memory stats (the CPU).

    python scripts/probes/memory_trace.py mem.csv --prompt "Hello" --max-tokens 64 [generate options]
"""

from __future__ import annotations

import csv
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from jaxinfer import generate  # noqa: E402
from jaxinfer.config.memory import _gib  # noqa: E402

CSV_HEADER = ("time_s", "pages_in_use", "weights_bytes", "kv_pool_bytes", "kv_used_bytes",
              "other_bytes")


def write_csv(tracker, path: str | os.PathLike) -> None:
    """All of ``tracker``'s rows (`MemoryTracker.rows`) as CSV under the header `CSV_HEADER`."""
    with open(path, "w", newline="") as f:
        csv.writer(f).writerows([CSV_HEADER, *([f"{r[0]:.6f}", *r[1:]] for r in tracker.rows)])


def report(tracker) -> str:
    """One line: weights / KV pool / pages in use / other, from ``tracker``'s latest snapshot."""
    _, used, _, _, used_bytes, other = tracker.rows[-1] if tracker.rows else (0.0, 0, 0, 0, 0, 0)
    other = _gib(other) if tracker.rows and tracker.measured else "n/a (not measured)"
    return (f"weights {_gib(tracker.weights_bytes)} | KV pool {_gib(tracker.kv_pool_bytes)} "
            f"({tracker.num_pages:,} pages) | pages in use {used:,}/{tracker.num_pages:,}"
            f" ({used / tracker.num_pages:.1%}, {_gib(used_bytes)}) | other {other}")


def main(argv: list[str] | None = None) -> int:
    """FILE, then generate's options; returns generate's exit code (2 also: FILE unwritable)."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0].startswith("-"):
        return generate.fail("usage: memory_trace.py FILE [python -m jaxinfer.generate options]")
    path, engines, make_llm = argv[0], [], generate.make_llm

    def traced_llm(*args, **kwargs):
        llm = make_llm(*args, **kwargs)
        llm.engine.trace_memory = True  # a snapshot after every step
        llm.engine.memory_snapshot()
        engines.append(llm.engine)
        return llm

    generate.make_llm = traced_llm
    try:
        code = generate.main(argv[1:])
    finally:
        generate.make_llm = make_llm
    if engines:
        try:
            write_csv(engines[0].memory, path)
        except OSError as e:
            return generate.fail(f"memory trace {path!r}: {e.strerror}")
        print(f"memory: {report(engines[0].memory)} (trace: {path})", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
