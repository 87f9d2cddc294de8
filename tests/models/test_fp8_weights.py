"""fp8 weights (`jaxinfer.models.quantize`, `layers.Weight`): e4m3 quantisation error within half
an ulp of float32 numpy references, the GEMM helper against float32 math on the dequantised
values, the declared tree, and the engine generating with ``quantization="fp8"`` exactly as the
float32 engine on the dequantised weights."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from tiny_model import TINY

from jaxinfer import LLM, SamplingParams, models
from jaxinfer.config import EngineConfig, ModelConfig
from jaxinfer.config.weights import QUANTIZED, shape_of
from jaxinfer.generate import build_parser
from jaxinfer.models.layers import Weight, dense
from jaxinfer.models.quantize import quantize_fp8, quantize_params

CFG = ModelConfig(**TINY)
BLOCKS = [None, (128, 128), (32, 16)]


def np_scales(w: np.ndarray, block) -> np.ndarray:
    """float32 reference of the scales: amax / 448 per output column, or per (bo, bi) block."""
    if block is None:
        amax = np.abs(w).max(0)
    else:
        bo, bi = block
        amax = np.array(
            [
                [np.abs(w[i : i + bi, o : o + bo]).max() for o in range(0, w.shape[1], bo)]
                for i in range(0, w.shape[0], bi)
            ]
        )
    return np.where(amax > 0, amax / 448.0, 1.0).astype(np.float32)


def np_expand(s: np.ndarray, shape, block) -> np.ndarray:
    if block is None:
        return np.broadcast_to(s[None], shape)
    return np.repeat(np.repeat(s, block[1], 0), block[0], 1)[: shape[0], : shape[1]]


def canonical(q) -> np.ndarray:
    """float64 [in, out] of `quantize_fp8`'s matrix: per channel it is K-major [out, in]."""
    return np.asarray(q).astype(np.float64).T


def wide_range_weights():
    """Columns spanning 1e-4..10 (so e4m3 subnormals appear) and one all-zero column."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((200, 300)) * np.logspace(-4, 1, 300)[None]
    w[:, 7] = 0.0
    w[3, 11] = 1e-7  # a tiny entry beside large ones in its block
    return w.astype(np.float32)


@pytest.mark.parametrize("block", BLOCKS)
def test_quantize_error_within_half_an_ulp(block):
    w = wide_range_weights()
    q, s = quantize_fp8(jnp.asarray(w), block)
    assert q.dtype == jnp.float8_e4m3fn and s.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(s), np_scales(w, block), rtol=1e-6)
    es = np_expand(np_scales(w, block), w.shape, block).astype(np.float64)
    qf = canonical(q) if block is None else np.asarray(q).astype(np.float64)
    x = w / es  # in units of the scale
    # e4m3: 3 mantissa bits, so half an ulp is <= |x| 2^-4 for normals, 2^-10 below 2^-6
    bound = np.maximum(np.abs(x) * 2.0**-4, 2.0**-10) * es
    err = np.abs(w - qf * es)
    assert np.all(err <= bound * (1 + 1e-6)), float((err / bound).max())
    assert np.abs(qf).max() == 448.0 and np.all(qf[:, 7] == 0)
    # rounding to nearest, not truncation: the mean error is well below the bound's
    assert float((err / bound).mean()) < 0.6


@pytest.mark.parametrize("block", BLOCKS)
def test_dense_matches_float32_reference_on_dequantised_weights(block):
    w = wide_range_weights()
    q, s = quantize_fp8(jnp.asarray(w), block)
    x = np.random.default_rng(1).standard_normal((3, 5, 200)).astype(np.float32)
    qf = canonical(q) if block is None else np.asarray(q).astype(np.float64)
    deq = qf * np_expand(np.asarray(s), w.shape, block)
    want = x.astype(np.float64) @ deq
    got = np.asarray(jax.jit(dense)(jnp.asarray(x), Weight(q, s, block)))
    assert got.shape == (3, 5, 300) and got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    got16 = np.asarray(dense(jnp.asarray(x, jnp.bfloat16), Weight(q, s, block)), np.float64)
    assert np.abs(got16 - want).max() < 2e-2 * np.abs(want).max()  # bf16 inputs and output


@pytest.mark.parametrize("block", [None, (128, 128)])
def test_declared_tree_and_quantised_init(block):
    cfg = ModelConfig(**dict(TINY, architecture="llama", weight_block_size=block))
    abstract = models.abstract_params(cfg, jnp.bfloat16, "fp8")
    params = jax.eval_shape(
        lambda k: models.init_params(cfg, k, jnp.bfloat16, "fp8"), jax.random.key(0)
    )
    spec = jax.tree_util.tree_map(lambda a: (a.shape, a.dtype), abstract)
    assert jax.tree_util.tree_map(lambda a: (a.shape, a.dtype), params) == spec
    layer = spec["layers"]["1"]
    for name in QUANTIZED:
        shape, dtype = layer[name]
        assert dtype == jnp.float8_e4m3fn and layer[name + "_scale"][1] == jnp.float32
        assert layer[name + "_scale"][0] == (  # per channel: the matrix is [out, in]
            (shape[0],) if block is None else (-(-shape[0] // 128), -(-shape[1] // 128))
        )
    assert spec["embed"][1] == jnp.bfloat16 and spec["lm_head"][1] == jnp.bfloat16
    assert spec["layers"]["0"]["attn_norm"][1] == jnp.bfloat16
    models.check_params(params, cfg, "fp8")
    with pytest.raises(ValueError, match="missing"):
        models.check_params(params, cfg)
    with pytest.raises(ValueError, match="quantization='int8' is invalid"):
        models.abstract_params(cfg, jnp.bfloat16, "int8")


def test_block_scaled_expert_stacks():
    """An MoE model with HF blocks (an FP8 checkpoint's: `init_params`, or `update_params` given
    float weights): each expert stack [E, in, out] quantised per expert as a matrix alone, scales
    f32[E, ceil(in/bi), ceil(out/bo)], declared so."""
    w = jax.random.normal(jax.random.key(0), (3, 80, 48))
    q, s = quantize_fp8(w, (16, 32), False)
    assert q.shape == (3, 80, 48) and s.shape == (3, 3, 3)
    for e in range(3):
        qe, se = quantize_fp8(w[e], (16, 32), False)
        assert np.array_equal(np.asarray(q[e], np.float32), np.asarray(qe, np.float32))
        np.testing.assert_array_equal(np.asarray(s[e]), np.asarray(se))
    moe = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
    cfg = ModelConfig(**{**TINY, "architecture": "qwen3_moe"}, **moe, weight_block_size=(16, 32))
    abstract = models.abstract_params(cfg, jnp.float32, "fp8")["layers"]["0"]
    init = jax.eval_shape(
        lambda k: models.init_params(cfg, k, jnp.float32, "fp8"), jax.random.key(0)
    )
    assert abstract["w_experts_gate_up_scale"].shape == (4, 2, 4)  # D = 64, 2 F_e = 64
    assert abstract["w_experts_down_scale"].shape == (4, 1, 4)
    assert jax.tree.map(lambda a: a.shape, init["layers"]["0"]) == jax.tree.map(
        lambda a: a.shape, abstract
    )


def test_per_channel_fp8_leaves_are_stored_k_major():
    """Per-channel fp8 matrices are stored K-major [out, in] (cuBLASLt's fp8 GEMM wants K
    contiguous in both operands) with f32[out] scales: declared so, and `quantize_params` of the
    canonical [in, out] tree gives that layout, its transpose within e4m3 rounding."""
    params = models.init_params(CFG, jax.random.key(5), jnp.float32)
    q = quantize_params(params)["layers"]["1"]
    abstract = models.abstract_params(CFG, jnp.bfloat16, "fp8")["layers"]["1"]
    for name in QUANTIZED:
        n_in, n_out = shape_of(name, CFG)
        assert abstract[name].shape == q[name].shape == (n_out, n_in), name
        assert abstract[name + "_scale"].shape == q[name + "_scale"].shape == (n_out,)
        w, s = np.asarray(params["layers"]["1"][name]), np.asarray(q[name + "_scale"])
        err = np.abs(canonical(q[name]) * s[None] - w)
        assert np.all(err <= (np.abs(w) * 2.0**-4 + s[None] * 2.0**-10) * (1 + 1e-6)), name


def test_k_major_dense_equals_float32_reference():
    """`dense` of a K-major e4m3 w8 [out, in] with scale f32[out]: W8A16 equals ``x @ (w8.T *
    scale)`` exactly (small-integer x and w8: every product and sum exact in f32, one rounding
    of the scaled output), W8A8 within e4m3's rounding of x (2^-4 of ``|x| @ |w|``)."""
    rng = np.random.default_rng(4)
    w8 = jnp.asarray(rng.integers(-16, 17, (48, 40)), jnp.float8_e4m3fn)  # [out, in], exact
    scale = jnp.asarray(rng.uniform(1e-3, 1.0, 48), jnp.float32)
    x = rng.integers(-8, 9, (2, 3, 40)).astype(np.float32)
    wf = np.asarray(w8).astype(np.float64).T * np.asarray(scale, np.float64)  # [in, out]
    want = (x.astype(np.float64) @ wf).astype(np.float32)
    got = np.asarray(jax.jit(dense)(jnp.asarray(x), Weight(w8, scale)))
    assert got.shape == (2, 3, 48) and got.dtype == np.float32
    np.testing.assert_array_equal(got, want)
    x = rng.standard_normal((2, 3, 40)).astype(np.float32)
    got = np.asarray(jax.jit(dense)(jnp.asarray(x), Weight(w8, scale, w8a8=True)))
    bound = 2.0**-4 * np.abs(x).astype(np.float64) @ np.abs(wf) + 1e-6
    assert np.all(np.abs(got - x.astype(np.float64) @ wf) <= bound)


def test_quantization_setting_is_validated_and_on_the_cli():
    with pytest.raises(ValueError, match=r"EngineConfig.quantization='int8' is invalid.*'fp8'"):
        EngineConfig(quantization="int8")
    assert build_parser().parse_args(["--quantization", "fp8"]).quantization == "fp8"
    assert build_parser().parse_args([]).quantization is None


def dequantised(params: dict) -> dict:
    """The float32 tree holding exactly the values an fp8 tree means (numpy, per channel: the
    K-major [out, in] matrices back in [in, out])."""
    layers = {}
    for i, layer in params["layers"].items():
        layers[i] = {k: v for k, v in layer.items() if not k.endswith("_scale")}
        for name in QUANTIZED:
            w = np.asarray(layer[name]).astype(np.float32)
            layers[i][name] = jnp.asarray((w * np.asarray(layer[name + "_scale"])[:, None]).T)
    return {**params, "layers": layers}


@pytest.fixture(scope="module")
def engines():
    params = models.init_params(CFG, jax.random.key(3), jnp.float32)
    kw = dict(max_model_len=64, num_pages=32, max_num_seqs=4)
    fp8 = LLM.from_params(CFG, params, quantization="fp8", **kw)
    ref = LLM.from_params(CFG, dequantised(fp8.engine.runner.params), **kw)
    return params, fp8, ref


def test_engine_generates_like_float32_on_dequantised_weights(engines):
    params, fp8, ref = engines
    assert fp8.engine.resolved.quantization == "fp8"
    assert fp8.engine.runner.params["layers"]["0"]["w_down"].dtype == jnp.float8_e4m3fn
    assert fp8.engine.runner.weight_bytes < ref.engine.runner.weight_bytes
    prompts = [[5, 17, 99, 3, 42], [7, 7, 200, 1], list(range(30, 50))]
    sp = SamplingParams(temperature=0.0, max_tokens=12, logprobs=1)
    got, want = fp8.generate(prompts, sp), ref.generate(prompts, sp)
    for g, w in zip(got, want):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        lp_g, lp_w = (
            [d[t].logprob for d, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]
            for o in (g, w)
        )
        np.testing.assert_allclose(lp_g, lp_w, rtol=1e-4, atol=1e-4)


def test_update_params_quantises_a_float_tree(engines):
    params, fp8, ref = engines
    new = jax.tree_util.tree_map(lambda a: a * 1.5, params)
    fp8.update_params(new)
    q = fp8.engine.runner.params["layers"]["1"]
    w = np.asarray(new["layers"]["1"]["wo"])
    np.testing.assert_allclose(np.asarray(q["wo_scale"]), np.abs(w).max(0) / 448, rtol=1e-6)
    assert q["wo"].dtype == ml_dtypes.float8_e4m3fn
    fp8.update_params(quantize_params(params))  # an fp8 tree goes in as it is
    old = quantize_params(params)  # an fp8 tree in the [in, out] layout: refused, with a hint
    old["layers"]["1"]["wqkv"] = old["layers"]["1"]["wqkv"].T
    with pytest.raises(ValueError, match=r"\['wqkv'\] is float8_e4m3fn.*per-channel matrices"):
        fp8.update_params(old)


def test_w8a8_dense_matches_numpy_on_quantised_activations():
    """W8A8 (`KernelConfig.fp8_gemm="w8a8"`): each token of x quantised to e4m3 with scale
    amax / 448 (ml_dtypes' rounding as the reference), the e4m3 product accumulated exactly."""
    w = wide_range_weights()
    q, s = quantize_fp8(jnp.asarray(w), None)
    x = np.random.default_rng(2).standard_normal((3, 5, 200)).astype(np.float32)
    x[0, 1] = 0.0  # an all-zero token: scale 1
    sx = np.abs(x).max(-1, keepdims=True) / 448.0
    sx = np.where(sx > 0, sx, 1.0)
    x8 = (x / sx).astype(ml_dtypes.float8_e4m3fn).astype(np.float64) * sx
    deq = canonical(q) * np.asarray(s)[None]
    want = x8 @ deq
    got = np.asarray(jax.jit(dense)(jnp.asarray(x), Weight(q, s, None, w8a8=True)))
    assert got.shape == (3, 5, 300) and got.dtype == np.float32 and not got[0, 1].any()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    w8a16 = np.asarray(dense(jnp.asarray(x), Weight(q, s, None)))
    assert 0 < np.abs(got - w8a16).max() < 0.1 * np.abs(w8a16).max()  # activation rounding


def test_w8a8_engine_close_to_w8a16(engines):
    """The same fp8 weights with e4m3 activations: prompt log-probabilities (teacher-forced)
    within the activations' rounding of W8A16's, and not identical (the W8A8 GEMM ran)."""
    params, fp8, _ = engines
    kw = dict(max_model_len=64, num_pages=32, max_num_seqs=4, kernels="fp8_gemm=w8a8")
    w8a8 = LLM.from_params(CFG, fp8.engine.runner.params, quantization="fp8", **kw)
    prompts = [[5, 17, 99, 3, 42], [7, 7, 200, 1], list(range(30, 50))]
    sp = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    got, want = w8a8.generate(prompts, sp), fp8.generate(prompts, sp)
    diffs = [
        abs(dg[t].logprob - dw[t].logprob)
        for g, w, p in zip(got, want, prompts)
        for dg, dw, t in zip(g.prompt_logprobs[1:], w.prompt_logprobs[1:], p[1:])
    ]
    assert len(diffs) == sum(len(p) - 1 for p in prompts)
    assert 0 < max(diffs) < 0.03, diffs
