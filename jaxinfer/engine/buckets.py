"""Shape buckets: the padded sizes that bound the number of compiled steps (host side, no JAX)."""

from __future__ import annotations

import bisect


def powers_of_two(lo: int, hi: int) -> tuple[int, ...]:
    """``lo, 2*lo, ...`` up to the first power >= hi, with ``hi`` itself as the last bucket."""
    out, b = [], lo
    while b < hi:
        out.append(b)
        b *= 2
    out.append(hi)
    return tuple(sorted(set(out)))


def batch_buckets(max_num_seqs: int) -> tuple[int, ...]:
    """Powers of two up to 64, then ``64 + k * max(16, max_num_seqs // 16)``, then
    ``max_num_seqs`` (BENCHMARKS.md: "Throughput"). Raises ValueError: not a positive integer."""
    if not isinstance(max_num_seqs, int) or max_num_seqs < 1:
        raise ValueError(f"max_num_seqs={max_num_seqs!r} must be a positive integer")
    small = powers_of_two(1, min(64, max_num_seqs))
    step = max(16, max_num_seqs // 16)
    return tuple(sorted(set(small + tuple(range(64 + step, max_num_seqs, step)) + (max_num_seqs,))))


def bucket(n: int, buckets: tuple[int, ...]) -> int:
    """Smallest bucket >= n. Raises ValueError: ``n`` exceeds the largest bucket."""
    i = bisect.bisect_left(buckets, n)
    if i == len(buckets):
        raise ValueError(f"size {n} exceeds the largest bucket {buckets[-1]}")
    return buckets[i]
