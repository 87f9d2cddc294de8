"""The paged decode kernel's tuning on the host (`pallas_kernels.paged_attention.tuning`): knobs
looked up in a tuned JSON table per (variant, device, page size, head dim, group, dtype) over the
defaults, its errors, and `choose_k_splits`. The kernel against the reference:
test_paged_decode.py."""

from __future__ import annotations

import json

import jax.numpy as jnp
import pytest

from pallas_kernels.paged_attention import tuning


def _h200_lookup(path, group=4):
    """`tuning.lookup` of the triton variant on an H200 at page size 16, head dim 128, bf16, from
    the table at ``path``."""
    return tuning.lookup(
        "triton",
        device_kind="NVIDIA H200",
        page_size=16,
        head_dim=128,
        group=group,
        dtype=jnp.bfloat16,
        path=path,
    )


def test_tuning_lookup_and_json(tmp_path):
    base = _h200_lookup(tmp_path / "absent.json")
    assert set(base) == set(tuning.KNOBS)
    rec = [
        {
            "variant": "triton",
            "device_kind": "NVIDIA H200",
            "page_size": 16,
            "head_dim": 128,
            "group": 4,
            "dtype": "bfloat16",
            "knobs": {"pages_per_block": 4, "num_stages": 3},
        }
    ]
    path = tmp_path / "tuned.json"
    path.write_text(json.dumps(rec))
    got = _h200_lookup(path)
    assert got["pages_per_block"] == 4 and got["num_stages"] == 3
    assert got["num_warps"] == base["num_warps"]
    other = _h200_lookup(path, group=8)
    assert other == base
    path.write_text(json.dumps([dict(rec[0], knobs={"block_q": 2})]))
    with pytest.raises(ValueError, match="unknown knobs"):
        _h200_lookup(path)
    with pytest.raises(ValueError, match="unknown variant"):
        tuning.lookup(
            "nope", device_kind="x", page_size=16, head_dim=128, group=4, dtype=jnp.bfloat16
        )


def test_choose_k_splits():
    assert tuning.choose_k_splits(64, 8, 16, 264) == 1  # 512 programs already
    assert tuning.choose_k_splits(1, 8, 16, 264) == 16  # capped at one split per block
    assert tuning.choose_k_splits(4, 8, 128, 264) == 9
    assert tuning.choose_k_splits(0, 8, 0, 264) == 1
