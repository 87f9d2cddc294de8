"""Argument checks shared by the library and the host side (imports nothing of jaxinfer, no JAX)."""

import numbers


def is_int(v, lo: int | None = None, *, numpy: bool = False) -> bool:
    """``v`` is an int (``numpy``: or a NumPy integer), not a bool, and ``>= lo`` if given."""
    return (
        isinstance(v, numbers.Integral if numpy else int)
        and not isinstance(v, bool)
        and (lo is None or v >= lo)
    )


def is_number(v) -> bool:
    """Whether ``v`` is a Python int or float and not a bool."""
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def check_int(what: str, v, lo: int, hi: int | None = None) -> None:
    """Raises ValueError ``"{what}={v!r} is invalid: ..."`` unless ``v`` is an int in [lo, hi]."""
    if not is_int(v, lo) or (hi is not None and v > hi):
        raise ValueError(
            f"{what}={v!r} is invalid: must be an integer "
            + (f">= {lo}" if hi is None else f"in [{lo}, {hi}]")
        )
