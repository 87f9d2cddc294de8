"""SmoothQuant for W8A8 (`jaxinfer.models.smoothquant`): the calibration maxima against numpy, the
factors against the paper's formula, the folded model equal to the unfolded one in float32, W8A8
closer to float32 with it on a model with an outlier channel, and the engine serving the folded,
quantised tree (from params, from a checkpoint, after `update_params`)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tiny_model import TINY, TINY_ENGINE, tiny_params_of

from jaxinfer import LLM, SamplingParams, models
from jaxinfer.config import ModelConfig
from jaxinfer.engine.llm_engine import calibration_ids
from jaxinfer.models.kernels import ModelKernels
from jaxinfer.models.kv_cache import init_kv_cache
from jaxinfer.models.quantize import quantize_params
from jaxinfer.models.smoothquant import activation_max, fold, smooth_params, smoothing_factors

CFG = ModelConfig(**TINY)  # qwen3: q/k norms; GQA, 2 query heads a KV head
IDS = np.random.default_rng(0).integers(3, 256, 48).astype(np.int32)
ENGINE = dict(TINY_ENGINE, quantization="fp8", kernels=TINY_ENGINE["kernels"] + ",fp8_gemm=w8a8")


@pytest.fixture(scope="module")
def params():
    return tiny_params_of(CFG)


def logits(params, cfg=CFG, ids=IDS, fp8_gemm="w8a16") -> np.ndarray:
    """f32[T, V] of ``ids`` as one sequence (one page) through `models.forward`."""
    T = len(ids)
    kv = init_kv_cache(cfg, 2, T, jnp.float32)
    kv = kv.replace(block_tables=jnp.ones((1, 1), jnp.int32), seq_lens=jnp.full((1,), T, jnp.int32))
    pos = jnp.arange(T, dtype=jnp.int32)[None]
    kernels = ModelKernels(fp8_gemm=fp8_gemm)
    hidden, _ = models.forward(
        params, cfg, jnp.asarray(ids)[None], pos, pos + T, kv, kernels=kernels
    )
    return np.asarray(models.compute_logits(params, cfg, hidden))[0]


def np_rms_norm(x, w, eps):
    return w * x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)


def test_activation_max_matches_numpy_and_follows_the_layers(params):
    """Layer 0's q|k|v input is the RMSNorm of the embeddings (numpy); doubling layer 1's
    attn_norm doubles exactly layer 1's q|k|v maxima (the calls are told apart by layer)."""
    amax = activation_max(params, CFG, IDS)
    assert {n: sorted(d) for n, d in amax.items()} == dict.fromkeys(
        ("wqkv", "wo", "w_gate_up", "w_down"), [0, 1]
    )
    assert amax["w_down"][1].shape == (CFG.intermediate_size,)
    x = np.asarray(params["embed"])[IDS]
    want = np.abs(
        np_rms_norm(x, np.asarray(params["layers"]["0"]["attn_norm"]), CFG.rms_norm_eps)
    ).max(0)
    np.testing.assert_allclose(amax["wqkv"][0], want, rtol=1e-5)
    layer1 = {**params["layers"]["1"], "attn_norm": params["layers"]["1"]["attn_norm"] * 2}
    doubled = activation_max({**params, "layers": {**params["layers"], "1": layer1}}, CFG, IDS)
    np.testing.assert_allclose(doubled["wqkv"][1], 2 * amax["wqkv"][1], rtol=1e-6)
    np.testing.assert_array_equal(doubled["wqkv"][0], amax["wqkv"][0])


def test_factors_are_the_papers(params):
    """s = amax^a / wmax^(1 - a) per input row (1 where amax is 0); o's per KV head: the maxima
    over its query heads' rows."""
    rng = np.random.default_rng(1)
    D, F, N, K, H = 64, 96, 4, 2, 16
    amax = {
        n: {0: rng.uniform(0.1, 50, d).astype(np.float32)}
        for n, d in (("wqkv", D), ("wo", N * H), ("w_down", F))
    }
    amax["wqkv"][0][5] = 0.0
    f = smoothing_factors({"layers": {"0": params["layers"]["0"]}}, CFG, amax, 0.25)["0"]
    assert sorted(f) == ["w_down", "wo", "wqkv"]
    layer = {n: np.abs(np.asarray(params["layers"]["0"][n])) for n in ("wqkv", "wo", "w_down")}
    want = amax["wqkv"][0] ** 0.25 / layer["wqkv"].max(1) ** 0.75
    want[5] = 1.0
    np.testing.assert_allclose(f["wqkv"], want, rtol=1e-5)
    xo = amax["wo"][0].reshape(K, N // K, H).max(1)
    wo = layer["wo"].max(1).reshape(K, N // K, H).max(1)
    np.testing.assert_allclose(f["wo"], xo**0.25 / wo**0.75, rtol=1e-5)
    np.testing.assert_allclose(
        f["w_down"], amax["w_down"][0] ** 0.25 / layer["w_down"].max(1) ** 0.75, rtol=1e-5
    )


def test_folded_model_equals_the_unfolded_one_in_float32(params):
    """The fold changes the weights (factors far from 1) but not the function: logits within
    float32 rounding; an MoE model's sparse layers keep their MLP, attention still folded."""
    folded, factors = smooth_params(params, CFG, IDS, 0.5)
    assert all(np.abs(np.log(s)).max() > 0.3 for f in factors.values() for s in f.values())
    assert not np.allclose(folded["layers"]["1"]["wo"], params["layers"]["1"]["wo"])
    want = logits(params)
    np.testing.assert_allclose(logits(folded), want, rtol=0, atol=2e-5 * np.abs(want).max())
    moe = ModelConfig(
        **{**TINY, "architecture": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 2},
        moe_intermediate_size=32,
        mlp_only_layers=(0,),
    )
    p = tiny_params_of(moe)
    folded, factors = smooth_params(p, moe, IDS, 0.5)
    assert sorted(factors["1"]) == ["wo", "wqkv"] and len(factors["0"]) == 4
    want = logits(p, moe)
    np.testing.assert_allclose(logits(folded, moe), want, rtol=0, atol=2e-5 * np.abs(want).max())


def test_smoothing_brings_w8a8_closer_to_float32_on_an_outlier_channel(params):
    """Channel 3 of every RMSNorm output 10^5 x the rest (the weights reading it 10^-5 x: the same
    float32 function): per-token e4m3 puts the other channels among the subnormals and W8A8's
    logits error triples; SmoothQuant (alpha 0.5) moves the range into the weights and the error
    is back to that of W8A8 on the model without the outlier."""
    layers = {}
    for key, layer in params["layers"].items():
        layer = dict(layer)
        for norm, w in (("attn_norm", "wqkv"), ("mlp_norm", "w_gate_up")):
            layer[norm] = layer[norm].at[3].multiply(1e5)
            layer[w] = layer[w].at[3].multiply(1e-5)
        layers[key] = layer
    outlier = {**params, "layers": layers}
    want = logits(params)
    np.testing.assert_allclose(logits(outlier), want, rtol=0, atol=1e-4 * np.abs(want).max())
    err = {
        name: np.abs(logits(quantize_params(p), fp8_gemm="w8a8") - want).mean()
        for name, p in (
            ("plain", params),
            ("outlier", outlier),
            ("smoothed", smooth_params(outlier, CFG, IDS, 0.5)[0]),
        )
    }
    assert err["outlier"] > 2 * err["plain"], err
    assert err["smoothed"] < 1.1 * err["plain"], err


@pytest.fixture(scope="module")
def text_engine(tiny_text_cfg, tiny_text_params, tiny_tokenizer):
    """The tiny text model served W8A8 from params (SmoothQuant by default, calibrated on the
    tokenizer's text)."""
    return LLM.from_params(tiny_text_cfg, tiny_text_params, tokenizer=tiny_tokenizer, **ENGINE)


def assert_trees_equal(got, want):
    jax.tree.map(
        lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), got, want
    )


def test_engine_serves_the_folded_quantised_tree(
    text_engine, tiny_text_cfg, tiny_text_params, tiny_tokenizer, tiny_checkpoint
):
    """W8A8 from params, and from a checkpoint, serves `quantize_params` of `smooth_params` over
    `calibration_ids` at the default alpha (0.4); smoothquant=0 serves the plain quantised tree;
    `update_params` folds the start's factors into a new float tree."""
    ids = calibration_ids(tiny_tokenizer)
    folded, factors = smooth_params(tiny_text_params, tiny_text_cfg, ids, 0.4)
    assert text_engine.engine.resolved.smoothquant == 0.4
    assert_trees_equal(text_engine.engine.runner.params, quantize_params(folded))
    from_ckpt = LLM(tiny_checkpoint, **ENGINE)
    assert_trees_equal(from_ckpt.engine.runner.params, quantize_params(folded))
    off = LLM.from_params(
        tiny_text_cfg,
        tiny_text_params,
        tokenizer=tiny_tokenizer,
        smoothquant=0,
        **ENGINE,
    )
    assert_trees_equal(off.engine.runner.params, quantize_params(tiny_text_params))
    new = jax.tree.map(lambda a: a * 1.5, tiny_text_params)
    text_engine.update_params(new)
    assert_trees_equal(
        text_engine.engine.runner.params, quantize_params(fold(new, tiny_text_cfg, factors))
    )
    text_engine.update_params(tiny_text_params)
    out = text_engine.generate(["hello there"], SamplingParams(temperature=0.0, max_tokens=4))
    assert len(out[0].outputs[0].token_ids) == 4
