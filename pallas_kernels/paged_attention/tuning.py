"""Tuned knobs of the Triton paged decode kernel: ``(variant, device_kind, page_size, head_dim,
group, dtype)`` -> `KNOBS`. Records of ``tuned_h200.json`` (scripts/tune_paged_attention.py:
``{"variant", "device_kind", "page_size", "head_dim", "group", "dtype", "knobs": {...}}``) win over
the device kind's `BUILTIN` entry, which wins over `DEFAULTS`."""

import json
from pathlib import Path

import jax
import numpy as np

from pallas_kernels.sizes import next_pow2

TUNED_FILE = Path(__file__).with_name("tuned_h200.json")
KNOBS = ("pages_per_block", "num_warps", "num_stages", "min_programs")
VARIANTS = ("triton",)

# Devices without a table entry (BENCHMARKS.md section "Paged decode attention").
DEFAULTS = {"pages_per_block": 2, "num_warps": 4, "num_stages": 4, "min_programs": 256}
BUILTIN = {"interpret": {"pages_per_block": 2, "num_warps": 4, "num_stages": 1, "min_programs": 1}}


def load_records(path: Path = TUNED_FILE) -> dict[tuple, dict]:
    """``{key: knobs}`` of a tuning file (module docstring; absent: {}); ValueError: bad record."""
    if not path.exists():
        return {}
    out = {}
    for i, rec in enumerate(json.loads(path.read_text())):
        try:
            key = (
                rec["variant"],
                rec["device_kind"],
                int(rec["page_size"]),
                int(rec["head_dim"]),
                int(rec["group"]),
                str(rec["dtype"]),
            )
            knobs = dict(rec["knobs"])
        except (KeyError, TypeError) as e:
            raise ValueError(f"{path}: record {i} lacks field {e}") from None
        if unknown := set(knobs) - set(KNOBS):
            raise ValueError(
                f"{path}: record {i} has unknown knobs {sorted(unknown)}; allowed: {KNOBS}"
            )
        out[key] = knobs
    return out


def lookup(
    variant: str,
    *,
    device_kind: str,
    page_size: int,
    head_dim: int,
    group: int,
    dtype,
    path: Path = TUNED_FILE,
) -> dict:
    """`KNOBS` of a shape; ``device_kind``: a device kind or "interpret". ValueError: variant."""
    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r}; tuned variants: {VARIANTS}")
    key = (variant, device_kind, int(page_size), int(head_dim), int(group), np.dtype(dtype).name)
    return {**DEFAULTS, **BUILTIN.get(device_kind, {}), **load_records(path).get(key, {})}


def choose_k_splits(batch: int, num_kv_heads: int, num_blocks: int, min_programs: int) -> int:
    """Sequence splits so that ``batch * num_kv_heads * k_splits >= min_programs``, at most one
    split per block of pages (`num_blocks` = cdiv(M, pages_per_block)) and at least 1."""
    return int(max(1, min(-(-min_programs // max(1, batch * num_kv_heads)), num_blocks)))


def resolve(
    variant: str,
    *,
    B: int,
    K: int,
    G: int,
    M: int,
    page_size: int,
    head_dim: int,
    dtype,
    interpret: bool,
    pages_per_block: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    k_splits: int | None = None,
) -> dict:
    """{"pages_per_block", "num_warps", "num_stages", "k_splits"} of one call (explicit ones win);
    k_splits None: `choose_k_splits`; table pages_per_block <= next_pow2(M), >= 16 keys (MMA)."""
    t = lookup(
        variant,
        device_kind="interpret" if interpret else jax.devices()[0].device_kind,
        page_size=page_size,
        head_dim=head_dim,
        group=G,
        dtype=dtype,
    )
    ppb = (
        pages_per_block
        if pages_per_block is not None
        else max(min(t["pages_per_block"], next_pow2(M)), -(-16 // page_size))
    )
    if k_splits is None:
        k_splits = choose_k_splits(B, K, -(-M // ppb), t["min_programs"])
    return {
        "pages_per_block": int(ppb),
        "num_warps": int(num_warps if num_warps is not None else t["num_warps"]),
        "num_stages": int(num_stages if num_stages is not None else t["num_stages"]),
        "k_splits": int(k_splits),
    }
