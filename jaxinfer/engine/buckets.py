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
    """Default decode batch buckets: powers of two up to 64, then ``64 + k * step`` with
    ``step = max(16, max_num_seqs // 16)`` below ``max_num_seqs``, which is always the last
    bucket. So above 64 a batch is padded by fewer than ``step`` rows, with at most about 16
    buckets there.

    Above 64 rows a decode step's GEMMs cost about as much per padded row as per real one, so
    power-of-two buckets (up to 2x padding) waste time there; vLLM pads decode batches to its
    CUDA-graph sizes (1, 2, 4, then multiples of 8) for the same reason. The step is coarser here
    because each bucket is one more compile of the whole step; at a very large ``max_num_seqs``
    a small batch above 64 then pads a lot (65 rows to 320 at 4096), so pass ``batch_buckets``
    explicitly there. On the H200 the throughput benchmark (max_num_seqs 256) gave 9,786 output
    tok/s with steps of 16 against 9,755 with steps of 32, at 23 compiled shapes against 17
    (BENCHMARKS.md, tenth session).

    Raises:
        ValueError: ``max_num_seqs`` is not a positive integer.
    """
    if not isinstance(max_num_seqs, int) or max_num_seqs < 1:
        raise ValueError(f"max_num_seqs={max_num_seqs!r} must be a positive integer")
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
