"""Paged decode-attention variants by name, all with the signature of
`reference.paged_decode_attention`:

    fn(q [B, N, H], k_pool [L, P, K, page_size, H], v_pool, block_tables i32[B, M], seq_lens i32[B],
       *, layer=0, scale, soft_cap=None, sliding_window=None, interpret=False, **tuning) -> [B, N, H]

Prefill variants (several causal query tokens per sequence) have the signature of
`reference.paged_attention`:

    fn(q [B, T, N, H], k_pool, v_pool, block_tables i32[B, M], seq_lens i32[B],
       q_positions i32[B, T], *, layer=0, scale, soft_cap=None, sliding_window=None,
       interpret=False, **tuning) -> [B, T, N, H]

A variant is imported lazily, so a missing optional back-end (jax_triton) fails only when asked for.
"""

from __future__ import annotations

import importlib
from typing import Callable

_VARIANTS = {
    "reference": ("pallas_kernels.paged_attention.reference", "paged_decode_attention"),
    "mosaic": ("pallas_kernels.paged_attention.mosaic", "paged_decode_attention"),
    "triton": ("pallas_kernels.paged_attention.triton_pallas", "paged_decode_attention"),
    "jax_triton": ("pallas_kernels.paged_attention.jax_triton_kernel", "paged_decode_attention"),
}

_PREFILL_VARIANTS = {
    "reference": ("pallas_kernels.paged_attention.reference", "paged_attention"),
    "triton": ("pallas_kernels.paged_attention.prefill_triton", "paged_prefill_attention"),
}


def names() -> tuple[str, ...]:
    """Registered variant names."""
    return tuple(_VARIANTS)


def get(name: str) -> Callable:
    """Return the decode-attention callable registered as ``name``.

    Raises:
        ValueError: unknown name (the message lists the registered ones).
    """
    if name not in _VARIANTS:
        raise ValueError(f"unknown paged-attention variant {name!r}; registered: {names()}")
    module, attr = _VARIANTS[name]
    return getattr(importlib.import_module(module), attr)


def prefill_names() -> tuple[str, ...]:
    """Registered prefill variant names."""
    return tuple(_PREFILL_VARIANTS)


def get_prefill(name: str) -> Callable:
    """Return the prefill-attention callable registered as ``name``.

    Raises:
        ValueError: unknown name (the message lists the registered ones).
    """
    if name not in _PREFILL_VARIANTS:
        raise ValueError(f"unknown prefill-attention variant {name!r}; registered: "
                         f"{prefill_names()}")
    module, attr = _PREFILL_VARIANTS[name]
    return getattr(importlib.import_module(module), attr)
