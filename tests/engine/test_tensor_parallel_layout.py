"""Tensor parallelism on the host, without devices or a subprocess: the per-device layout of fp8
block scales and K-major per-channel matrices (`jaxinfer.runner.parallel.engine_layout`,
`check_tp`) and the per-device memory plan (scripts/plan_memory.py and its CLI). The engine on
4 CPU devices: test_tensor_parallel.py."""

import dataclasses

import numpy as np
import pytest

from tests.engine.tp_models import FP8_CFG


@pytest.mark.parametrize("tp", [2, 3])
def test_fp8_block_scales_follow_their_columns(tp):
    """`engine_layout` of an fp8 matrix of `FP8_CFG` and of its HF block scales [in/bi, out/bo]
    means the engine layout of the dequantised matrix (the KV head copied to each device); blocks
    that do not fall whole into each device's share: ValueError naming the sizes."""
    import jax.numpy as jnp

    from jaxinfer.config import ModelConfig
    from jaxinfer.config.model import check_tp
    from jaxinfer.config.weights import LAYER, QUANTIZED, shape_of
    from jaxinfer.models.quantize import expand_scale, quantize_fp8
    from jaxinfer.runner.parallel import engine_layout

    cfg, rng = ModelConfig(**dict(FP8_CFG, weight_block_size=(16, 8))), np.random.default_rng(0)
    check_tp(cfg, tp)
    for name in QUANTIZED:
        w = rng.standard_normal(shape_of(name, cfg)).astype(np.float32)
        q, s = (np.asarray(a) for a in quantize_fp8(jnp.asarray(w), cfg.weight_block_size))
        q2, s2 = engine_layout(name, q, cfg, tp), engine_layout(name + "_scale", s, cfg, tp)
        assert s2.shape[LAYER[name].split == "column"] % tp == 0  # split with the matrix
        got = q2.astype(np.float32) * np.asarray(expand_scale(s2, q2.shape, (16, 8)))
        want = q.astype(np.float32) * np.asarray(expand_scale(s, q.shape, (16, 8)))
        np.testing.assert_array_equal(got, engine_layout(name, want, cfg, tp))
    with pytest.raises(
        ValueError,
        match=rf"weight_block_size=\(32, 8\) and tensor_parallel_size="
        rf"{tp}: each device needs whole FP8 blocks .* K'\*H/tp=16,",
    ):
        check_tp(dataclasses.replace(cfg, weight_block_size=(32, 8)), tp)


@pytest.mark.parametrize("tp", [2, 3])
def test_fp8_per_channel_k_major_follows_its_rows(tp):
    """`engine_layout` of a per-channel fp8 matrix (K-major [out, in]) and its scale [out]: the
    engine layout of the dequantised [in, out] matrix, transposed (the K-major split axis)."""
    import jax.numpy as jnp

    from jaxinfer.config import ModelConfig
    from jaxinfer.config.weights import QUANTIZED, shape_of
    from jaxinfer.models.quantize import quantize_fp8
    from jaxinfer.runner.parallel import engine_layout

    cfg, rng = ModelConfig(**FP8_CFG), np.random.default_rng(1)
    for name in QUANTIZED:
        w = rng.standard_normal(shape_of(name, cfg)).astype(np.float32)
        q, s = (np.asarray(a) for a in quantize_fp8(jnp.asarray(w)))
        q2, s2 = engine_layout(name, q, cfg, tp), engine_layout(name + "_scale", s, cfg, tp)
        want = (q.astype(np.float32) * s[:, None]).T  # [in, out]
        got = q2.astype(np.float32) * s2[:, None]
        np.testing.assert_array_equal(got.T, engine_layout(name, want, cfg, tp))


def test_plan_per_device_bytes():
    """Qwen3-8B (published config): KV heads split (tp 16 > K = 8: one copy per device), the
    matrices split, the norms whole on each device."""
    from script_module import load_script

    from jaxinfer.config.memory import kv_bytes_per_token
    from jaxinfer.config.weights import device_bytes as param_count  # parameters per device

    cfg = load_script("plan_memory").PRESETS["qwen3-8b"]
    L, D, H = cfg.num_layers, cfg.hidden_size, cfg.head_dim
    assert [kv_bytes_per_token(cfg, 2, tp) for tp in (1, 2, 8, 16)] == [
        147_456,
        73_728,
        18_432,
        18_432,
    ]
    whole = L * (2 * D + 2 * H) + D
    assert param_count(cfg, 2) == (param_count(cfg) - whole) // 2 + whole


def test_plan_cli_tensor_parallel_size(capsys):
    from script_module import load_script

    plan_main = load_script("plan_memory").main

    args = ["--model", "qwen3-8b", "--context", "4096", "--device-memory-gib", "80"]
    assert plan_main(args + ["--tensor-parallel-size", "2"]) == 0
    out = capsys.readouterr().out
    assert "2 device(s)" in out and "73,728 B" in out
    assert plan_main(args + ["--tensor-parallel-size", "3"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "num_heads=32 is not divisible by tensor_parallel_size=3" in err[0]
