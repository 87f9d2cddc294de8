"""Integer size helpers of the kernels (Triton block shapes are powers of 2); `raise_first`."""


def is_pow2(n: int) -> bool:
    """Whether ``n`` is a positive power of 2 (1, 2, 4, ...)."""
    return n > 0 and not n & (n - 1)


def next_pow2(n: int) -> int:
    """The smallest power of 2 >= ``n`` (1 for n <= 1)."""
    return 1 << max(0, (n - 1).bit_length())


def round_up(n: int, multiple: int) -> int:
    """``n`` rounded up to a multiple of ``multiple`` (> 0)."""
    return -(-n // multiple) * multiple


def raise_first(checks) -> None:
    """ValueError(msg) for the first ``(bad, msg)`` pair whose ``bad`` is true."""
    for bad, msg in checks:
        if bad:
            raise ValueError(msg)
