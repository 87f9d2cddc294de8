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


def check_priority(priority, n: int) -> None:
    """vLLM's ``generate(priority=...)`` for ``n`` prompts under first-come scheduling (the only
    policy): None, or ``n`` ints, all 0. ValueError naming the value otherwise."""
    if priority is None:
        return
    if not isinstance(priority, (list, tuple)) or not all(is_int(p, numpy=True) for p in priority):
        raise ValueError(f"priority={priority!r} is invalid: give None or a list of ints")
    if len(priority) != n:
        raise ValueError(
            f"priority={priority!r} is invalid: {len(priority)} values for {n} prompts; "
            "give one per prompt"
        )
    if bad := [p for p in priority if p != 0]:
        raise ValueError(
            f"priority={priority!r} is invalid: priority {bad[0]} given, but priority scheduling "
            "is not supported (first-come scheduling only: every priority must be 0)"
        )
