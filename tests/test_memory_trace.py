"""Tests for scripts/probes/memory_trace.py (the tracker, its CSV and report line) and
scripts/plan_memory.py's `device_memory_stats`."""

from __future__ import annotations

import csv

import numpy as np
import pytest
from script_module import load_script

from jaxinfer.config.memory import GIB

PLANNER = load_script("plan_memory")
PRESETS, plan_memory = PLANNER.PRESETS, PLANNER.plan_memory
device_memory_stats = PLANNER.device_memory_stats
TRACE = load_script("probes/memory_trace")  # the tracker, its CSV and report line
MemoryTracker = TRACE.MemoryTracker

QWEN3_8B = PRESETS["qwen3-8b"]


def test_memory_tracker_csv_round_trip(tmp_path):
    rng = np.random.default_rng(0)
    clock_values = iter(np.cumsum(rng.uniform(0.01, 0.5, size=20)).tolist())
    w, page, P = 16_381_470_720, 16 * 147_456, 47_601
    tr = MemoryTracker(w, page, P, clock=lambda: next(clock_values))
    pages = rng.integers(1, P + 1, size=8).tolist()
    devs = (rng.integers(0, 4 * GIB, size=8) + w + page * P).tolist()
    for i, (p, d) in enumerate(zip(pages, devs)):
        tr.snapshot(int(p), int(d) if i % 2 else None)
    path = tmp_path / "mem.csv"
    TRACE.write_csv(tr, path)
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    assert rows[0] == [
        "time_s",
        "pages_in_use",
        "weights_bytes",
        "kv_pool_bytes",
        "kv_used_bytes",
        "other_bytes",
    ]
    assert len(rows) == 1 + 8
    for i, (r, p, d) in enumerate(zip(rows[1:], pages, devs)):
        assert int(r[1]) == p
        assert int(r[2]) == w and int(r[3]) == page * P
        assert int(r[4]) == p * page
        assert int(r[5]) == (d - w - page * P if i % 2 else 0)
    times_read = [float(r[0]) for r in rows[1:]]
    assert all(b > a for a, b in zip(times_read, times_read[1:])) and times_read[0] > 0
    assert [tuple(map(int, r[1:])) for r in rows[1:]] == [s[1:] for s in tr.rows]
    np.testing.assert_allclose(times_read, [s[0] for s in tr.rows], atol=1e-6)


def test_memory_tracker_report_and_validation():
    plan = plan_memory(QWEN3_8B, device_bytes=141 * GIB, context=4096)
    tr = MemoryTracker(plan.weight_bytes, plan.page_bytes, plan.num_pages)
    assert tr.kv_pool_bytes == plan.kv_pool_bytes
    assert "not measured" in TRACE.report(tr)
    used = 1234
    extra = 3 * GIB + 12345
    tr.snapshot(used, plan.weight_bytes + plan.kv_pool_bytes + extra)
    line = TRACE.report(tr)
    assert "\n" not in line
    assert f"weights {plan.weight_bytes / GIB:,.2f} GiB" in line
    assert f"KV pool {plan.kv_pool_bytes / GIB:,.2f} GiB" in line
    assert f"pages in use {used:,}/{plan.num_pages:,}" in line
    assert f"{used * plan.page_bytes / GIB:,.2f} GiB" in line
    assert f"other {extra / GIB:,.2f} GiB" in line
    for bad in (-1, plan.num_pages + 1, 1.5):
        with pytest.raises(ValueError, match="pages_in_use"):
            tr.snapshot(bad)
    with pytest.raises(ValueError, match="device_bytes_in_use"):
        tr.snapshot(1, -5)
    with pytest.raises(ValueError, match="num_pages=0"):
        MemoryTracker(1, 1, 0)


def test_device_memory_stats():
    import jax

    dev = jax.devices()[0]
    if dev.platform == "cpu":
        assert device_memory_stats() is None

    class Fake:
        def __init__(self, stats):
            self.stats = stats

        def memory_stats(self):
            if isinstance(self.stats, Exception):
                raise self.stats
            return self.stats

    assert device_memory_stats(Fake({"bytes_in_use": 7, "bytes_limit": 99, "x": 1})) == (7, 99)
    assert device_memory_stats(Fake(None)) is None
    assert device_memory_stats(Fake(NotImplementedError())) is None
