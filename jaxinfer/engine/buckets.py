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


def bucket(n: int, buckets: tuple[int, ...]) -> int:
    """Smallest bucket >= n.

    Raises:
        ValueError: ``n`` exceeds the largest bucket.
    """
    i = bisect.bisect_left(buckets, n)
    if i == len(buckets):
        raise ValueError(f"size {n} exceeds the largest bucket {buckets[-1]}")
    return buckets[i]
