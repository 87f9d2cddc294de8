"""HF FP8 checkpoints (config.json ``quantization_config``: quant_method "fp8", dynamic activation
scales, ``weight_block_size`` [128, 128]; float8_e4m3fn ``<name>.weight`` + f32
``<name>.weight_scale_inv``), made here from a random HF model with the block scales its weights
imply: loaded as they are, logits against HF transformers on the dequantised weights (tight) and
on the original weights (loose); the engine runs them as fp8 unasked; the mapping's errors; a
float checkpoint quantised at load."""

import json

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from models.test_models_vs_hf import (
    hf_logits,
    hf_numpy_state,
    make_hf_model,
    rel_err,  # noqa: E402
    run_paged_greedy,
)
from safetensors.flax import save_file  # noqa: E402

from jaxinfer import LLM, SamplingParams  # noqa: E402
from jaxinfer.config import ModelConfig  # noqa: E402
from jaxinfer.runner.loading import load_params, params_from_hf  # noqa: E402

# q 8*32 = 256, k and v 4*32 = 128, gate and up 128 rows: whole 128-row blocks per fused part;
# D = 64 inputs: one partial block.
SIZES = dict(
    hidden_size=64, intermediate_size=128, num_attention_heads=8, num_key_value_heads=4, head_dim=32
)
PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
QCONFIG = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
PROMPT = [3, 141, 59, 26, 53, 58, 97, 93, 23, 84]


def block_quantise(w: np.ndarray, b=128) -> tuple[np.ndarray, np.ndarray]:
    """HF layout w f32[out, in] -> (e4m3 [out, in], scale_inv f32[ceil(out/bo), ceil(in/bi)]),
    blocks ``b`` = (bo, bi) (an int: square), scale = block amax / 448, so that w ~ q * scale
    (numpy and ml_dtypes only)."""
    bo, bi = (b, b) if isinstance(b, int) else b
    O, I = -(-w.shape[0] // bo), -(-w.shape[1] // bi)
    amax = np.array(
        [
            [np.abs(w[o * bo : (o + 1) * bo, i * bi : (i + 1) * bi]).max() for i in range(I)]
            for o in range(O)
        ]
    )
    scale = np.where(amax > 0, amax / 448.0, 1.0).astype(np.float32)
    q = np.clip(w / expand(scale, w.shape, b), -448, 448).astype(ml_dtypes.float8_e4m3fn)
    return q, scale


def expand(scale: np.ndarray, shape, b=128) -> np.ndarray:
    """``scale`` [ceil(out/bo), ceil(in/bi)] repeated over the elements of [out, in] ``shape``."""
    bo, bi = (b, b) if isinstance(b, int) else b
    return np.repeat(np.repeat(scale, bo, 0), bi, 1)[: shape[0], : shape[1]]


def fp8_tensors(state: dict, b=128) -> tuple[dict, dict]:
    """(the FP8 checkpoint's tensors, the float32 tensors they mean) of HF-named float32
    ``state``: each `PROJ` matrix (an MoE expert's too) in blocks ``b`` (`block_quantise`)."""
    out, deq = {}, {}
    for name, w in state.items():
        if name.split(".")[-2] in PROJ:
            q, s = block_quantise(w, b)
            out[name], out[name + "_scale_inv"] = q, s
            deq[name] = q.astype(np.float32) * expand(s, w.shape, b)
        else:
            out[name] = deq[name] = w
    return out, deq


def write_checkpoint(path, model, tensors, qconfig=QCONFIG) -> None:
    """``tensors`` and ``model``'s config.json with ``qconfig`` (None: none) into ``path``."""
    save_file({k: jnp.asarray(v) for k, v in tensors.items()}, str(path / "model.safetensors"))
    config = model.config.to_dict() | ({"quantization_config": qconfig} if qconfig else {})
    (path / "config.json").write_text(json.dumps(config))


@pytest.fixture(scope="module")
def fp8_checkpoint(tmp_path_factory):
    """(dir, the original HF model, HF model on the dequantised weights)."""
    path = tmp_path_factory.mktemp("fp8")
    model = make_hf_model("qwen3", seed=21, **SIZES)
    tensors, deq = fp8_tensors(hf_numpy_state(model))
    write_checkpoint(path, model, tensors)
    ref = make_hf_model("qwen3", seed=21, **SIZES)
    ref.load_state_dict({k: torch.from_numpy(v) for k, v in deq.items()})
    return path, model, ref


def test_fp8_checkpoint_loads_as_it_is(fp8_checkpoint):
    path, model, ref = fp8_checkpoint
    cfg, params = load_params(path, jnp.float32)
    assert cfg.weight_block_size == (128, 128)
    layer = params["layers"]["1"]
    assert layer["wqkv"].dtype == jnp.float8_e4m3fn and layer["wqkv"].shape == (64, 512)
    assert layer["wqkv_scale"].shape == (1, 4) and layer["w_down_scale"].shape == (1, 1)
    assert params["embed"].dtype == jnp.float32 and params["lm_head"].dtype == jnp.float32
    _, logits, _, _ = run_paged_greedy(params, cfg, [PROMPT], 0, 4)
    # the same values in float32 on both sides: only summation order differs
    assert rel_err(logits[0], hf_logits(ref, PROMPT)) < 1e-4
    # e4m3 keeps 3 mantissa bits: each weight within 2^-4 relative (half an ulp), a few % rms,
    # compounding over 2 layers of this small-width model (0.08-0.09 on seeds 5 and 21); a wrong
    # scale layout (transposed, a part misplaced) gives errors of order 1
    err = rel_err(logits[0], hf_logits(model, PROMPT))
    assert 1e-3 < err < 0.2, err


def test_engine_runs_an_fp8_checkpoint_as_fp8_unasked(fp8_checkpoint):
    path, _, ref = fp8_checkpoint
    llm = LLM(str(path), skip_tokenizer_init=True, max_model_len=64, num_pages=16, max_num_seqs=2)
    assert llm.engine.resolved.quantization == "fp8"
    assert llm.engine.runner.params["layers"]["0"]["w_gate_up"].dtype == jnp.float8_e4m3fn
    out = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    with torch.no_grad():
        want = ref.generate(
            torch.tensor([PROMPT]), max_new_tokens=8, do_sample=False, min_new_tokens=8
        )[0, len(PROMPT) :].tolist()
    assert list(out[0].outputs[0].token_ids) == want


@pytest.fixture(scope="module")
def fp8_named():
    model = make_hf_model("qwen3", seed=22, **SIZES)
    tensors, _ = fp8_tensors(hf_numpy_state(model))
    config = dict(model.config.to_dict(), quantization_config=QCONFIG)
    return tensors, ModelConfig.from_hf_config(config), config


def test_fp8_checkpoint_errors(fp8_named):
    tensors, cfg, config = fp8_named
    name = "model.layers.1.mlp.up_proj.weight"
    bad = dict(tensors, **{name: tensors[name].astype(np.float32)})
    with pytest.raises(ValueError, match=r"up_proj.*\(128, 64\) \(float32\).*in float8_e4m3fn"):
        params_from_hf(bad, cfg, jnp.float32)
    bad = {k: v for k, v in tensors.items() if k != name + "_scale_inv"}
    with pytest.raises(ValueError, match=r"missing tensors.*up_proj.weight_scale_inv"):
        params_from_hf(bad, cfg, jnp.float32)
    s = name + "_scale_inv"
    with pytest.raises(ValueError, match=r"up_proj.weight_scale_inv.*\(1, 2\).*expected \(1, 1\)"):
        params_from_hf(dict(tensors, **{s: np.ones((1, 2), np.float32)}), cfg, jnp.float32)
    with pytest.raises(ValueError, match="quantization_config=.*gptq.*not supported"):
        ModelConfig.from_hf_config(dict(config, quantization_config={"quant_method": "gptq"}))


def test_fused_parts_must_fill_whole_blocks():
    model = make_hf_model("qwen3", seed=23, **dict(SIZES, num_key_value_heads=2))  # k: 64 rows
    tensors, _ = fp8_tensors(hf_numpy_state(model))
    cfg = ModelConfig.from_hf_config(dict(model.config.to_dict(), quantization_config=QCONFIG))
    with pytest.raises(
        ValueError,
        match=r"wqkv part 'k' has 64 output rows, not a multiple of "
        r"weight_block_size's 128",
    ):
        params_from_hf(tensors, cfg, jnp.float32)


def test_float_checkpoint_quantised_at_load(tmp_path):
    model = make_hf_model("llama", seed=24)
    model.save_pretrained(tmp_path)
    cfg, params = load_params(tmp_path, jnp.float32, quantization="fp8")
    w = model.model.layers[0].mlp.down_proj.weight.detach().numpy()  # [out, in]: HF's, K-major
    layer = params["layers"]["0"]
    amax = np.abs(w).max(1, keepdims=True)  # per output channel
    np.testing.assert_allclose(np.asarray(layer["w_down_scale"]), amax[:, 0] / 448, rtol=1e-6)
    deq = (
        np.asarray(layer["w_down"]).astype(np.float32) * np.asarray(layer["w_down_scale"])[:, None]
    )
    assert np.all(np.abs(deq - w) <= np.abs(w) * 2.0**-4 + 2.0**-10 * amax)
    assert cfg.weight_block_size is None and params["embed"].dtype == jnp.float32
