"""W8A8 with each GEMM input quantised by the op that produces it (``fp8_act_quant="fused"``:
`kernels.ActQuant`, `pallas_kernels.act_quant` interpreted on the CPU) inside the model, against
XLA quantising it in `layers.dense` ("xla"), on a tiny Qwen3-MoE whose layer 0 is dense and layer
1 sparse (its experts take no W8A8: its MLP norm stays plain), and the one decision
(`llama.fused_quant`) of where the fused path is taken.

Tolerances: interpreted, the kernels' bodies are the jnp code's roundings step for step
(tests/kernel_tests/test_act_quant.py). In bfloat16, compiled with XLA's excess precision off
(`STRICT`; on, XLA may skip roundings to bf16 in one program and not in the other), the logits
are the same bits. In float32 (the CPU engine's dtype) there is no bf16 rounding to skip; the
f32 sums of squares may be summed in another order, which shows in the last bits of the scales:
logits within 2^-16 of the largest, far below what one e4m3 value a step (2^-4) apart moves.
Both: the same greedy tokens, and the kernels are in the traced step (so the comparison fails
if the fused path is silently not taken)."""

import dataclasses
import re
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tiny_model import TINY, tiny_params_of

from jaxinfer import models
from jaxinfer.config import ModelConfig
from jaxinfer.models.kernels import ActQuant, ModelKernels, model_kernels
from jaxinfer.models.kv_cache import init_kv_cache
from jaxinfer.models.layers import Quantized, StepContext, Weight, dense
from jaxinfer.models.llama import fused_quant
from jaxinfer.models.quantize import FP8, quantize_params

from .test_model_kernels import kernel_config

MOE = dict(architecture="qwen3_moe", num_experts=4, num_experts_per_tok=2)
CFG = ModelConfig(**{**TINY, **MOE}, moe_intermediate_size=32, mlp_only_layers=(0,))
PROMPT, T = 12, 20  # greedy tokens PROMPT..T-1, each from a step over the whole buffer
STRICT = {"xla_allow_excess_precision": False}
KNOBS = re.compile(r"_m\d+_c\d+$")  # a kernel name's rows a program and chunk


def pallas_calls(jaxpr) -> list[str]:
    """The kernel names (less their ``_m<rows>_c<chunk>`` knobs) of the ``pallas_call``s in
    ``jaxpr`` and the jaxprs nested in it, once per call site."""
    names = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            names.append(KNOBS.sub("", eqn.params["name"]))
        for value in eqn.params.values():
            if hasattr(sub := getattr(value, "jaxpr", value), "eqns"):
                names += pallas_calls(sub)
    return names


def greedy(params, dtype, act_quant: ActQuant):
    """Greedy tokens PROMPT..T-1 of a random prompt (each step the whole buffer of T tokens
    through `models.forward` as one sequence, one compile), the last step's logits f32[T, V] and
    the step's Pallas kernels (`pallas_calls`)."""
    kv = init_kv_cache(CFG, 2, T, dtype)
    kv = kv.replace(block_tables=jnp.ones((1, 1), jnp.int32), seq_lens=jnp.full((1,), T, jnp.int32))
    pos = jnp.arange(T, dtype=jnp.int32)[None]
    kernels = ModelKernels(fp8_gemm="w8a8", fp8_act_quant=act_quant)

    def step(params, tokens):
        hidden, _ = models.forward(params, CFG, tokens, pos, pos + T, kv, kernels=kernels)
        return models.compute_logits(params, CFG, hidden)[0]

    tokens = np.zeros((1, T), np.int32)
    tokens[0, :PROMPT] = np.random.default_rng(0).integers(3, CFG.vocab_size, PROMPT)
    run = jax.jit(step, compiler_options=STRICT)
    for t in range(PROMPT, T):
        logits = np.asarray(run(params, tokens))
        tokens[0, t] = logits[t - 1].argmax()
    return tokens[0, PROMPT:], logits, pallas_calls(jax.make_jaxpr(step)(params, tokens).jaxpr)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_fused_quantisation_gives_the_xla_paths_tokens_and_logits(dtype):
    def cast(path, leaf):  # the compute dtype; e4m3 matrices and their f32 scales kept
        keep = leaf.dtype != jnp.float32 or str(path[-1].key).endswith("_scale")
        return leaf if keep else leaf.astype(dtype)

    params = jax.tree_util.tree_map_with_path(cast, quantize_params(tiny_params_of(CFG)))
    want, want_logits, plain = greedy(params, dtype, ActQuant())
    got, logits, fused = greedy(params, dtype, ActQuant("fused", interpret=True))
    assert plain == []
    # layer 0: both norms and the SwiGLU product; layer 1 (experts): its attention norm only
    assert sorted(fused) == ["add_rms_norm_quant"] * 3 + ["silu_mul_quant"]
    np.testing.assert_array_equal(got, want)
    assert float(np.std(want_logits)) > 0.1
    if dtype == jnp.bfloat16:
        np.testing.assert_array_equal(logits, want_logits)
    else:
        atol = 2**-16 * float(np.abs(want_logits).max())
        np.testing.assert_allclose(logits, want_logits, rtol=0, atol=atol)


def test_the_fused_step_lowers_to_triton_for_a_gpu():
    """Compiled (not interpreted), the step's kernels lower to Triton for a GPU at the tiny
    model's sizes ([B, T, D] rows flattened; checked without a GPU, on abstract params)."""
    params = models.abstract_params(CFG, jnp.bfloat16, "fp8")
    kv = init_kv_cache(CFG, 2, T, jnp.bfloat16)
    pos = jnp.arange(T, dtype=jnp.int32)[None]
    kernels = ModelKernels(fp8_gemm="w8a8", fp8_act_quant=ActQuant("fused"))
    step = jax.jit(lambda p, tok: models.forward(p, CFG, tok, pos, pos, kv, kernels=kernels)[0])
    tokens = jax.ShapeDtypeStruct((1, T), jnp.int32)
    text = step.trace(params, tokens).lower(lowering_platforms=("cuda",)).as_text()
    names = {KNOBS.sub("", n) for n in re.findall(r'name = "(\w+)"', text)}
    assert "xla.gpu.triton" in text and names == {"add_rms_norm_quant", "silu_mul_quant"}


def test_one_decision_takes_the_fused_path_where_it_applies():
    """`fused_quant`: a W8A8 weight of an input width the kernels take with fp8_act_quant
    "fused" on one device, no LoRA, no calibration probe; `model_kernels` carries the knob;
    `dense` refuses a `Quantized` input for a weight that is not W8A8."""
    kc = kernel_config(fp8_gemm="w8a8", fp8_act_quant="fused")
    fused = model_kernels(kc)
    assert fused.fp8_act_quant == ActQuant("fused")
    w8a8 = Weight(jnp.zeros((4, 8), FP8), jnp.ones((4,)), None, True)
    ctx = StepContext(*[None] * 6)
    assert fused_quant(w8a8, fused, ctx) is fused.fp8_act_quant
    not_taken = [
        (w8a8, model_kernels(kernel_config(fp8_gemm="w8a8")), ctx),  # "xla"
        (dataclasses.replace(w8a8, w8a8=False), fused, ctx),  # W8A16
        (None, fused, ctx),  # a leaf the layer has not (an MoE layer's w_gate_up)
        (Weight(jnp.zeros((4, 33), FP8), jnp.ones((4,)), None, True), fused, ctx),  # in = 33
        (w8a8, fused, ctx._replace(lora=object())),
        (w8a8, dataclasses.replace(fused, mesh=types.SimpleNamespace(size=2)), ctx),
        (w8a8, dataclasses.replace(fused, observe=object()), ctx),
    ]
    assert all(fused_quant(*case) is None for case in not_taken)
    x = Quantized(jnp.zeros((2, 8), FP8), jnp.ones((2, 1)), jnp.bfloat16)
    assert dense(x, w8a8).shape == (2, 4) and dense(x, w8a8).dtype == jnp.bfloat16
    with pytest.raises(ValueError, match="Quantized input needs a W8A8 weight"):
        dense(x, dataclasses.replace(w8a8, w8a8=False))
