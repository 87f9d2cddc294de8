"""An HF FP8 checkpoint of a Qwen3-MoE model (issue 47 item 3), in Qwen/Qwen3-30B-A3B-FP8's
layout: every expert's gate/up/down_proj float8_e4m3fn with block ``weight_scale_inv``, the
router and norms in float. Made here from the tiny random HF model of tests/models/test_moe.py at
D = 80, quantised in blocks (block_out, block_in) = (16, 32): non-square, so a transposed scale
layout fails, and D's input blocks partial (80 = 32 + 32 + 16). Greedy tokens and
log-probabilities of `LLM` (ragged_dot: the experts dequantised in the step) against HF
transformers on the dequantised weights (float32); the Pallas grouped GEMM (interpret mode, the
block scales inside its K loop) against ragged_dot and a numpy dequantisation; tensor
parallelism's whole-block rule for the experts."""

import dataclasses
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from models.test_moe import STEPS, check_output, dense_reference, hf_moe  # noqa: E402
from tiny_model import TINY_ENGINE  # noqa: E402

from checkpoints.test_fp8_checkpoint import expand, fp8_tensors, write_checkpoint  # noqa: E402
from checkpoints_tools.loader import iter_tensors  # noqa: E402
from jaxinfer import LLM, SamplingParams  # noqa: E402
from jaxinfer.config import ModelConfig  # noqa: E402
from jaxinfer.config.model import check_tp  # noqa: E402
from jaxinfer.models.kernels import GroupedGemm  # noqa: E402
from jaxinfer.models.layers import Weight  # noqa: E402
from jaxinfer.models.moe import moe_mlp  # noqa: E402

BLOCK = (16, 32)  # HF weight_block_size: (block_out, block_in)
QCONFIG = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [16, 32]}
# F, F_e and the q, k, v widths whole blocks (fused parts must be), and at tp = 2 too
SIZES = dict(hidden_size=80, intermediate_size=128, moe_intermediate_size=64)


def write_fp8_moe(path: pathlib.Path, seed: int = 0) -> None:
    """The FP8 checkpoint of ``hf_moe(seed, **SIZES)`` into ``path / "fp8"``, the float32
    weights it means into ``path / "deq"`` (both HF directories)."""
    model = hf_moe(seed, **SIZES)
    model.save_pretrained(path / "float")  # one tensor per expert and projection, as Qwen's
    state = {k: np.asarray(v, np.float32) for k, v in iter_tensors(path / "float")}
    tensors, deq = fp8_tensors(state, BLOCK)
    for name, arrays, qc in (("fp8", tensors, QCONFIG), ("deq", deq, None)):
        (path / name).mkdir(parents=True)
        write_checkpoint(path / name, model, arrays, qc)


@pytest.fixture(scope="module")
def fp8_moe(tmp_path_factory):
    """(the FP8 checkpoint's directory, HF's model on its dequantised weights, float32)."""
    path = tmp_path_factory.mktemp("qwen3-moe-fp8")
    write_fp8_moe(path)
    ref = transformers.Qwen3MoeForCausalLM.from_pretrained(path / "deq", dtype=torch.float32)
    return path / "fp8", ref.eval()


@pytest.fixture(scope="module")
def fp8_llm(fp8_moe):
    return LLM(str(fp8_moe[0]), skip_tokenizer_init=True, **TINY_ENGINE)


def test_block_scaled_experts_load_as_they_are(fp8_llm):
    assert fp8_llm.engine.resolved.quantization == "fp8"
    layers = fp8_llm.engine.runner.params["layers"]
    sparse = layers["0"]
    assert sparse["w_experts_gate_up"].dtype == jnp.float8_e4m3fn
    assert sparse["w_experts_gate_up"].shape == (8, 80, 128)  # [E, in, out]
    assert sparse["w_experts_gate_up_scale"].shape == (8, 3, 8)  # [E, ceil(80/32), 128/16]
    assert sparse["w_experts_down_scale"].shape == (8, 2, 5)  # [E, 64/32, 80/16]
    assert np.ptp(np.asarray(sparse["w_experts_down_scale"])) > 0  # a scale per block
    assert sparse["router"].dtype == jnp.float32
    assert layers["1"]["w_down_scale"].shape == (4, 5)  # the dense layer's


def test_greedy_and_logprobs_match_hf_on_dequantised_weights(fp8_llm, fp8_moe):
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 256, size=n).tolist() for n in (13, 5)]
    sp = SamplingParams(temperature=0.0, max_tokens=STEPS, ignore_eos=True, logprobs=3)
    outs = fp8_llm.generate([{"prompt_token_ids": p} for p in prompts], sp)
    for out, ids in zip(outs, prompts):
        check_output(out.outputs[0], fp8_moe[1], ids)


def numpy_dequantised(w: Weight) -> np.ndarray:
    """f32[E, in, out] of a block-scaled stack (scale [E, in/bi, out/bo], HF's transposed)."""
    m, s = np.asarray(w.w).astype(np.float32), np.asarray(w.scale)
    return np.stack([(q.T * expand(e.T, q.T.shape, BLOCK)).T for q, e in zip(m, s)])


def test_pallas_grouped_gemm_applies_the_block_scales(fp8_llm):
    """Layer 0's loaded experts through `moe_mlp` with the Pallas kernel (interpret mode) equal
    ragged_dot's and every expert on every token on the numpy-dequantised stacks."""
    layer = fp8_llm.engine.runner.params["layers"]["0"]
    gu, down = (
        Weight(layer[n], layer[n + "_scale"], BLOCK)
        for n in ("w_experts_gate_up", "w_experts_down")
    )
    x = jax.random.normal(jax.random.key(0), (37, 80))
    run = jax.jit(moe_mlp, static_argnames=("top_k", "norm_topk_prob", "gemm"))
    got = {
        g: np.asarray(
            run(
                x,
                layer["router"],
                gu,
                down,
                top_k=2,
                norm_topk_prob=True,
                gemm=GroupedGemm(g, True),
            )
        )
        for g in ("ragged_dot", "triton")
    }
    np.testing.assert_allclose(got["triton"], got["ragged_dot"], rtol=1e-5, atol=1e-5)
    want = dense_reference(
        x, layer["router"], numpy_dequantised(gu), numpy_dequantised(down), 2, True
    )
    np.testing.assert_allclose(got["triton"], np.asarray(want), rtol=1e-5, atol=1e-5)


def test_tensor_parallel_needs_whole_blocks_in_each_experts_share(fp8_moe):
    cfg = ModelConfig.from_checkpoint(fp8_moe[0])
    assert cfg.weight_block_size == BLOCK
    check_tp(cfg, 2)  # F_e / 2 = 32: whole (16, 32) blocks
    with pytest.raises(
        ValueError,
        match=r"weight_block_size=\(16, 32\) and tensor_parallel_size=2: .*each expert's.*"
        r"moe_intermediate_size/tp=16",
    ):
        check_tp(dataclasses.replace(cfg, moe_intermediate_size=32), 2)
    # Qwen3-30B-A3B-FP8: F_e = 768 in blocks of 128 splits over 2 devices, not over 4 (192 each)
    big = dict(num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768)
    qwen = ModelConfig("qwen3_moe", 151936, 2048, 6144, 48, 32, 4, 128, **big)
    qwen = dataclasses.replace(qwen, weight_block_size=(128, 128))
    check_tp(qwen, 2)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=4: .*moe_intermediate_size/tp=192"):
        check_tp(qwen, 4)
