"""Paged-attention variants by name, imported lazily: `DECODE` (`get`) with
`reference.paged_decode_attention`'s arguments, `PREFILL` (`get_prefill`) with
`reference.paged_attention`'s, plus ``interpret=False, **tuning``."""

import functools
import importlib
from collections.abc import Callable

# name -> (module of pallas_kernels.paged_attention, function)
DECODE = {
    "reference": ("reference", "paged_decode_attention"),
    "mosaic": ("mosaic", "paged_decode_attention"),
    "triton": ("triton_pallas", "paged_decode_attention"),
}
PREFILL = {
    "reference": ("reference", "paged_attention"),
    "triton": ("prefill_triton", "paged_prefill_attention"),
    "mosaic": ("prefill_mosaic", "paged_prefill_attention"),  # explicit only: `auto` is triton
}

# GPU device kinds (JAX ``Device.device_kind``) each variant's GPU suite and benchmarks passed on.
VALIDATED = {"mosaic": ("NVIDIA H200",), "triton": ("NVIDIA H200",)}
# Variants that lower on any CUDA GPU, in fallback order (mosaic needs sm_90a).
PORTABLE = ("triton", "reference")


def for_device(name: str, device_kind: str | None) -> str:
    """``name``, or the first `PORTABLE` variant when ``name`` is neither portable nor validated on
    ``device_kind`` (None: not checked; e.g. "NVIDIA B200" for "mosaic" gives "triton")."""
    if device_kind is None or name in PORTABLE or device_kind in VALIDATED.get(name, ()):
        return name
    return PORTABLE[0]


def _load(table: dict, kind: str, name: str) -> Callable:
    """The callable of ``table`` registered as ``name``; ValueError listing the names if unknown."""
    if name not in table:
        raise ValueError(f"unknown {kind}-attention variant {name!r}; registered: {tuple(table)}")
    module, attr = table[name]
    return getattr(importlib.import_module("pallas_kernels.paged_attention." + module), attr)


get = functools.partial(_load, DECODE, "paged")  # get(name): the decode variant ``name``
get_prefill = functools.partial(_load, PREFILL, "prefill")  # get_prefill(name): the prefill one
