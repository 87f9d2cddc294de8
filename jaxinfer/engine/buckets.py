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
    """Default decode batch buckets: powers of two up to 64, then every multiple of
    ``max(16, max_num_seqs // 16)`` up to ``max_num_seqs`` (which is always a bucket).

    Above 64 rows a decode step's GEMMs cost about as much per padded row as per real one, so
    power-of-two buckets (up to 2x padding) waste time there; vLLM pads decode batches to its
    CUDA-graph sizes (1, 2, 4, then multiples of 8) for the same reason. The step is coarser here
    because each bucket is one more compile of the whole step. On the H200 the throughput
    benchmark (max_num_seqs 256) gave 9,786 output tok/s with steps of 16 against 9,755 with
    steps of 32, at 23 compiled shapes against 17 (BENCHMARKS.md, tenth session).
    """
    small = powers_of_two(1, min(64, max_num_seqs))
    step = max(16, max_num_seqs // 16)
    return tuple(sorted(set(small + tuple(range(64 + step, max_num_seqs, step)) + (max_num_seqs,))))


def bucket(n: int, buckets: tuple[int, ...]) -> int:
    """Smallest bucket >= n.

    Raises:
        ValueError: ``n`` exceeds the largest bucket.
    """
    i = bisect.bisect_left(buckets, n)
    if i == len(buckets):
        raise ValueError(f"size {n} exceeds the largest bucket {buckets[-1]}")
    return buckets[i]
