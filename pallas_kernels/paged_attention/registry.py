"""Paged-attention variants by name, imported lazily (a missing optional back-end such as
jax_triton fails only when asked for).

Decode variants (`names`, `get`) have the signature of `reference.paged_decode_attention`:

    fn(q [B, N, H], k_pool [L, P, K, page_size, H], v_pool, block_tables i32[B, M], seq_lens i32[B],
       *, layer=0, scale, soft_cap=None, sliding_window=None, interpret=False, **tuning) -> [B, N, H]

Prefill variants (`prefill_names`, `get_prefill`) that of `reference.paged_attention`:

    fn(q [B, T, N, H], k_pool, v_pool, block_tables i32[B, M], seq_lens i32[B],
       q_positions i32[B, T], *, layer=0, scale, soft_cap=None, sliding_window=None,
       interpret=False, **tuning) -> [B, T, N, H]
"""

from __future__ import annotations

import importlib
from typing import Callable

_PKG = "pallas_kernels.paged_attention."
_VARIANTS = {
    "reference": (_PKG + "reference", "paged_decode_attention"),
    "mosaic": (_PKG + "mosaic", "paged_decode_attention"),
    "triton": (_PKG + "triton_pallas", "paged_decode_attention"),
    "jax_triton": (_PKG + "jax_triton_kernel", "paged_decode_attention"),
}
_PREFILL_VARIANTS = {
    "reference": (_PKG + "reference", "paged_attention"),
    "triton": (_PKG + "prefill_triton", "paged_prefill_attention"),
}


def _load(table: dict, kind: str, name: str) -> Callable:
    if name not in table:
        raise ValueError(f"unknown {kind}-attention variant {name!r}; registered: {tuple(table)}")
    module, attr = table[name]
    return getattr(importlib.import_module(module), attr)


def names() -> tuple[str, ...]:
    """Registered decode variant names."""
    return tuple(_VARIANTS)


def get(name: str) -> Callable:
    """The decode-attention callable registered as ``name``; ValueError (listing the registered
    names) if unknown."""
    return _load(_VARIANTS, "paged", name)


def prefill_names() -> tuple[str, ...]:
    """Registered prefill variant names."""
    return tuple(_PREFILL_VARIANTS)


def get_prefill(name: str) -> Callable:
    """The prefill-attention callable registered as ``name``; ValueError (listing the registered
    names) if unknown."""
    return _load(_PREFILL_VARIANTS, "prefill", name)
