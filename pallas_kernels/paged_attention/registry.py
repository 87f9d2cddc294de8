"""Paged-attention variants by name, imported lazily: decode (`names`, `get`) with
`reference.paged_decode_attention`'s arguments, prefill (`prefill_names`, `get_prefill`)
`reference.paged_attention`'s, plus ``interpret=False, **tuning``."""

import importlib
from typing import Callable

_PKG = "pallas_kernels.paged_attention."
_VARIANTS = {name: (_PKG + module, "paged_decode_attention") for name, module in (
    ("reference", "reference"), ("mosaic", "mosaic"), ("triton", "triton_pallas"))}
_PREFILL_VARIANTS = {"reference": (_PKG + "reference", "paged_attention"),
                     "triton": (_PKG + "prefill_triton", "paged_prefill_attention")}

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
    if name not in table:
        raise ValueError(f"unknown {kind}-attention variant {name!r}; registered: {tuple(table)}")
    module, attr = table[name]
    return getattr(importlib.import_module(module), attr)


def names() -> tuple[str, ...]:
    """Registered decode variant names."""
    return tuple(_VARIANTS)


def prefill_names() -> tuple[str, ...]:
    """Registered prefill variant names."""
    return tuple(_PREFILL_VARIANTS)


def get(name: str) -> Callable:
    """The decode callable registered as ``name``; ValueError listing the names if unknown."""
    return _load(_VARIANTS, "paged", name)


def get_prefill(name: str) -> Callable:
    """The prefill callable registered as ``name``; ValueError listing the names if unknown."""
    return _load(_PREFILL_VARIANTS, "prefill", name)
