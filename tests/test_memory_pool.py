"""Tests for jaxinfer.config.memory's pool sizing on a GPU: ``gpu_memory_utilization`` as a
fraction of the whole card, and a page count that stays the same across starts."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from jaxinfer.config import ModelConfig
from jaxinfer.config.memory import GIB


def test_gpu_memory_utilization_is_a_fraction_of_the_whole_card(monkeypatch):
    """vLLM's meaning: with JAX's allocator at its default 75% of a 100 GiB card (bytes_limit 75
    GiB), utilization 0.6 leaves 60 GiB - the activation reserve (5 GiB) for weights + KV; 0.9
    is more than the allocator may take: a ValueError that says how to allow it."""
    from jaxinfer.config import EngineConfig, resolve
    from jaxinfer.config.memory import (
        XLA_MEM_FRACTION_ENV,
        card_bytes_usable,
        engine_pool_pages,
        kv_pool_pages,
    )

    monkeypatch.delenv(XLA_MEM_FRACTION_ENV, raising=False)
    assert card_bytes_usable(0.6, 75 * GIB) == 55 * GIB
    with pytest.raises(
        ValueError, match=f"allocator may use only 0.75 of the card.*{XLA_MEM_FRACTION_ENV}=0.9"
    ):
        card_bytes_usable(0.9, 75 * GIB)
    monkeypatch.setenv(XLA_MEM_FRACTION_ENV, "0.9")
    assert card_bytes_usable(0.9, 90 * GIB) == 85 * GIB
    cfg = ModelConfig("llama", 32000, 4096, 11008, 32, 32, 8, 128)
    r = resolve(cfg, EngineConfig(gpu_memory_utilization=0.9), "gpu")
    stats = {"bytes_limit": 90 * GIB, "bytes_in_use": 14 * GIB}
    assert engine_pool_pages(r, stats) == kv_pool_pages(
        cfg, page_size=16, dtype_bytes=2, usable_bytes=85 * GIB, used_bytes=14 * GIB
    )


def test_gpu_memory_utilization_sets_jax_fraction_only_before_jax_starts(monkeypatch):
    """`LLM` sets XLA_PYTHON_CLIENT_MEM_FRACTION=U where JAX has not started and the variable is
    unset (a fresh process); never once a backend is up (this one) or when the user set it."""
    from jaxinfer.config.memory import XLA_MEM_FRACTION_ENV
    from jaxinfer.llm import _claim_gpu_memory

    code = (
        "import os; from jaxinfer.llm import _claim_gpu_memory; _claim_gpu_memory(0.8); "
        f"print(os.environ.get('{XLA_MEM_FRACTION_ENV}'))"
    )
    env = {k: v for k, v in os.environ.items() if k != XLA_MEM_FRACTION_ENV}
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert run.stdout.strip() == "0.8", run.stderr
    run = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=dict(env, **{XLA_MEM_FRACTION_ENV: "0.5"}),
    )
    assert run.stdout.strip() == "0.5", run.stderr
    import jax

    jax.devices()
    monkeypatch.delenv(XLA_MEM_FRACTION_ENV, raising=False)
    _claim_gpu_memory(0.8)
    assert XLA_MEM_FRACTION_ENV not in os.environ


def test_pool_pages_stay_the_same_when_bytes_in_use_moves_by_mibs():
    """The pool's page count is a step input shape, so it is part of every compilation-cache
    key: bytes in use that differ by a few MiB between two starts (freed load temporaries)
    give the same pool, rounded up to `USED_BYTES_STEP`; a GiB more gives a smaller one."""
    from jaxinfer.config import EngineConfig, resolve
    from jaxinfer.config.memory import USED_BYTES_STEP, engine_pool_pages, kv_pool_pages

    cfg = ModelConfig("llama", 32000, 4096, 11008, 32, 32, 8, 128)
    r = resolve(cfg, EngineConfig(), "gpu")
    pages = [
        engine_pool_pages(r, {"bytes_limit": 140 * GIB, "bytes_in_use": 16 * GIB + d})
        for d in (1, 5 << 20, 37 << 20)
    ]
    assert (
        pages[0]
        == pages[1]
        == pages[2]
        == kv_pool_pages(
            cfg,
            page_size=16,
            dtype_bytes=2,
            usable_bytes=int(r.engine.memory_fraction * 140 * GIB),
            used_bytes=16 * GIB + USED_BYTES_STEP,
        )
    )
    assert engine_pool_pages(r, {"bytes_limit": 140 * GIB, "bytes_in_use": 18 * GIB}) < pages[0]


def test_lora_pool_is_taken_from_the_kv_budget():
    """The LoRA pool's bytes, counted by hand for a Llama-2-7B shape (D 4096, F 11008, 32
    layers, 32 heads, 8 KV heads of 128): per layer, slot and rank, G * (in + out) of each fused
    group of G modules (b block diagonal): qkv 3 * (4096 + 6144), o 4096 + 4096, gate_up 2 *
    (4096 + 22016), down 11008 + 4096 = 106240 elements; the same count as the arrays
    `init_pool` allocates (a small model); the KV pool gets what is left after it; a pool that
    leaves no room is a ValueError naming max_loras, max_lora_rank and the bytes."""
    import jax
    import jax.numpy as jnp

    from jaxinfer.config import EngineConfig, resolve
    from jaxinfer.config.memory import USED_BYTES_STEP, engine_pool_pages, kv_pool_pages
    from jaxinfer.lora.peft import pool_bytes
    from jaxinfer.runner.lora import init_pool

    cfg = ModelConfig("llama", 32000, 4096, 11008, 32, 32, 8, 128)
    assert pool_bytes(cfg, 4, 16, 2) == 2 * 32 * 4 * 16 * 106240 == 435_159_040
    small = ModelConfig("llama", 256, 64, 96, 2, 4, 2, 16)
    arrays = jax.tree.leaves(init_pool(small, 3, 4, jnp.bfloat16))
    assert sum(x.nbytes for x in arrays) == pool_bytes(small, 3, 4, 2)
    ec = EngineConfig(enable_lora=True, max_loras=4, max_lora_rank=16)
    r, stats = resolve(cfg, ec, "gpu"), {"bytes_limit": 40 * GIB, "bytes_in_use": 14 * GIB}
    lora = pool_bytes(cfg, 4, 16, r.dtype_bytes)
    assert engine_pool_pages(r, stats, lora_bytes=lora) == kv_pool_pages(
        cfg,
        page_size=16,
        dtype_bytes=2,
        usable_bytes=int(r.engine.memory_fraction * 40 * GIB),
        used_bytes=14 * GIB + lora,
    )
    assert engine_pool_pages(r, stats, lora_bytes=lora) < engine_pool_pages(r, stats)
    huge = pool_bytes(cfg, 64, 512, 2)  # 64 slots of rank 512: 223 GB
    ec = EngineConfig(enable_lora=True, max_loras=64, max_lora_rank=512)
    with pytest.raises(
        ValueError,
        match=rf"LoRA pool does not fit: EngineConfig.max_loras=64 x max_lora_rank=512 "
        rf"takes {huge:,} B",
    ):
        engine_pool_pages(resolve(cfg, ec, "gpu"), stats, lora_bytes=huge)
    assert USED_BYTES_STEP == GIB  # 14 GiB in use is a whole step: used as it is above
