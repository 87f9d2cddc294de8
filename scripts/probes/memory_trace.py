"""Probe: weights / KV pool / pages in use / other device bytes over a generate run, as CSV.

Runs the ``python -m jaxinfer.generate`` CLI with a `MemoryTracker` snapshotting after every
engine step (`trace`, a hook on the engine's step loop) (one row before generation), writes the
rows to FILE under `CSV_HEADER` and prints the last one as a line on stderr (`report`).
``other_bytes``: device bytes in use - weights - KV pool, 0 where the device reports no memory
stats (the CPU).

    python scripts/probes/memory_trace.py mem.csv --prompt "Hello" --max-tokens 64
        [generate options]
"""

from __future__ import annotations

import csv
import os
import sys
import time
from collections.abc import Callable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from jaxinfer import generate  # noqa: E402
from jaxinfer.checks import check_int  # noqa: E402
from jaxinfer.config.memory import _gib, kv_bytes_per_token  # noqa: E402
from scripts.plan_memory import device_memory_stats  # noqa: E402

CSV_HEADER = (
    "time_s",
    "pages_in_use",
    "weights_bytes",
    "kv_pool_bytes",
    "kv_used_bytes",
    "other_bytes",
)


class MemoryTracker:
    """Weights / KV pool / pages in use / other bytes over time: `rows`, one (time_s,
    pages_in_use, weights, KV pool, KV used, other bytes) per `snapshot`; ``time_s``: seconds
    since the tracker started; other: device bytes in use - weights - KV pool when measured
    (``measured``: the last row's was), else 0. ``page_bytes``: one page of K and V, all layers;
    ``num_pages`` includes the null page; ``clock``: seconds (default ``time.monotonic``).
    Raises ValueError: a size out of range."""

    def __init__(
        self,
        weights_bytes: int,
        page_bytes: int,
        num_pages: int,
        clock: Callable[[], float] | None = None,
    ) -> None:
        for name, v, lo in (
            ("weights_bytes", weights_bytes, 0),
            ("page_bytes", page_bytes, 1),
            ("num_pages", num_pages, 1),
        ):
            check_int(f"MemoryTracker: {name}", v, lo)
        self.weights_bytes, self.page_bytes, self.num_pages = weights_bytes, page_bytes, num_pages
        self.kv_pool_bytes, self._clock = page_bytes * num_pages, clock or time.monotonic
        self._t0, self.rows = self._clock(), []
        self.measured = False

    def snapshot(self, pages_in_use: int, device_bytes_in_use: int | None = None) -> tuple:
        """Record and return one row. Raises ValueError: ``pages_in_use`` outside [0, num_pages]
        or ``device_bytes_in_use`` negative."""
        check_int("MemoryTracker.snapshot: pages_in_use", pages_in_use, 0, self.num_pages)
        if device_bytes_in_use is not None:
            check_int("MemoryTracker.snapshot: device_bytes_in_use", device_bytes_in_use, 0)
        self.measured = device_bytes_in_use is not None
        self.rows.append(
            (
                self._clock() - self._t0,
                pages_in_use,
                self.weights_bytes,
                self.kv_pool_bytes,
                pages_in_use * self.page_bytes,
                device_bytes_in_use - self.weights_bytes - self.kv_pool_bytes
                if self.measured
                else 0,
            )
        )
        return self.rows[-1]


def trace(engine) -> MemoryTracker:
    """A `MemoryTracker` of ``engine`` (an `LLMEngine`; one device's bytes) with one row now and
    one after every step its loop reads back (the loop's ``complete`` hook wrapped)."""
    runner, complete = engine.runner, engine.loop.complete
    tracker = MemoryTracker(
        runner.weight_bytes,
        engine.page_size
        * kv_bytes_per_token(
            runner.model_config,
            runner.resolved.kv_dtype_bytes,
            runner.resolved.engine.tensor_parallel_size,
        ),
        runner.num_pages,
    )

    def snapshot() -> None:
        bm = engine.block_manager
        tracker.snapshot(
            bm.num_usable_pages - bm.num_free_pages, (device_memory_stats() or (None,))[0]
        )

    def traced(done, host_times):
        finished = complete(done, host_times)
        snapshot()
        return finished

    engine.loop.complete = traced
    snapshot()
    return tracker


def write_csv(tracker, path: str | os.PathLike) -> None:
    """All of ``tracker``'s rows (`MemoryTracker.rows`) as CSV under the header `CSV_HEADER`."""
    with open(path, "w", newline="") as f:
        csv.writer(f).writerows([CSV_HEADER, *([f"{r[0]:.6f}", *r[1:]] for r in tracker.rows)])


def report(tracker) -> str:
    """One line: weights / KV pool / pages in use / other, from ``tracker``'s latest snapshot."""
    _, used, _, _, used_bytes, other = tracker.rows[-1] if tracker.rows else (0.0, 0, 0, 0, 0, 0)
    other = _gib(other) if tracker.rows and tracker.measured else "n/a (not measured)"
    return (
        f"weights {_gib(tracker.weights_bytes)} | KV pool {_gib(tracker.kv_pool_bytes)} "
        f"({tracker.num_pages:,} pages) | pages in use {used:,}/{tracker.num_pages:,}"
        f" ({used / tracker.num_pages:.1%}, {_gib(used_bytes)}) | other {other}"
    )


def main(argv: list[str] | None = None) -> int:
    """FILE, then generate's options; returns generate's exit code (2 also: FILE unwritable)."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0].startswith("-"):
        return generate.fail("usage: memory_trace.py FILE [python -m jaxinfer.generate options]")
    path, trackers, make_llm = argv[0], [], generate.make_llm

    def traced_llm(*args, **kwargs):
        llm = make_llm(*args, **kwargs)
        trackers.append(trace(llm.engine))
        return llm

    generate.make_llm = traced_llm
    try:
        code = generate.main(argv[1:])
    finally:
        generate.make_llm = make_llm
    if trackers:
        try:
            write_csv(trackers[0], path)
        except OSError as e:
            return generate.fail(f"memory trace {path!r}: {e.strerror}")
        print(f"memory: {report(trackers[0])} (trace: {path})", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
