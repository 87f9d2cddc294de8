"""The HF name-mapping table (through `jaxinfer.runner.loading.params_from_hf`) and the safetensors
loader: CASES.md C9 (weight tying) and the missing / unmapped / duplicate / wrong-shape errors.
Logits are checked against HF transformers on the same tensors."""

from __future__ import annotations

import json
import warnings

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from safetensors.numpy import save_file  # noqa: E402

from checkpoints_tools import loader  # noqa: E402
from checkpoints_tools.mapping import HF_TO_PARAMS  # noqa: E402
from jaxinfer.config import ModelConfig  # noqa: E402
from jaxinfer.models import fused_parts  # noqa: E402
from jaxinfer.runner.loading import load_params, params_from_hf  # noqa: E402

from .test_models_vs_hf import hf_logits, hf_numpy_state, make_hf_model, rel_err, run_paged_greedy  # noqa: E402

REL_TOL = 1e-4
ARCHS = ("llama", "qwen3")


def hf_cfg(model, **kw) -> ModelConfig:
    d = model.config.to_dict()
    d.update(kw)
    return ModelConfig.from_hf_config(d)


def assert_logits_match(model, params, cfg):
    prompt = np.random.default_rng(7).integers(0, cfg.vocab_size, size=10).tolist()
    _, logits, _, _ = run_paged_greedy(params, cfg, [prompt], 0, 4)
    err = rel_err(logits[0], hf_logits(model, prompt))
    assert err < REL_TOL, f"rel err {err:.2e}"


def no_warnings(fn, *args):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return fn(*args)


# ----------------------------------------------------------------------------- C9: weight tying
@pytest.mark.parametrize("arch", ARCHS)
def test_tied_without_lm_head_tensor(arch):
    model = make_hf_model(arch, seed=1, tie_word_embeddings=True)
    tensors = hf_numpy_state(model)
    del tensors["lm_head.weight"]
    params, cfg = no_warnings(params_from_hf, tensors, hf_cfg(model), jnp.float32)
    assert cfg.tie_word_embeddings and "lm_head" not in params
    assert_logits_match(model, params, cfg)


@pytest.mark.parametrize("arch", ARCHS)
def test_untied(arch):
    model = make_hf_model(arch, seed=2, tie_word_embeddings=False)
    tensors = hf_numpy_state(model)
    params, cfg = no_warnings(params_from_hf, tensors, hf_cfg(model), jnp.float32)
    assert not cfg.tie_word_embeddings
    np.testing.assert_array_equal(np.asarray(params["lm_head"]), tensors["lm_head.weight"].T)
    assert_logits_match(model, params, cfg)


@pytest.mark.parametrize("arch", ARCHS)
def test_tied_with_lm_head_equal_to_embedding(arch):
    model = make_hf_model(arch, seed=3, tie_word_embeddings=True)
    tensors = hf_numpy_state(model)
    np.testing.assert_array_equal(tensors["lm_head.weight"], tensors["model.embed_tokens.weight"])
    params, cfg = no_warnings(params_from_hf, tensors, hf_cfg(model), jnp.float32)
    assert cfg.tie_word_embeddings and "lm_head" not in params
    assert_logits_match(model, params, cfg)


@pytest.mark.parametrize("arch", ARCHS)
def test_config_tied_but_lm_head_differs_warns_and_uses_lm_head(arch):
    model = make_hf_model(arch, seed=4, tie_word_embeddings=False)  # a distinct lm_head
    tensors = hf_numpy_state(model)
    with pytest.warns(UserWarning, match="lm_head"):
        params, cfg = params_from_hf(tensors, hf_cfg(model, tie_word_embeddings=True), jnp.float32)
    assert not cfg.tie_word_embeddings and "lm_head" in params
    assert_logits_match(model, params, cfg)  # HF with its own (untied) head


def test_config_untied_without_lm_head_warns_and_ties():
    model = make_hf_model("llama", seed=5, tie_word_embeddings=True)
    tensors = hf_numpy_state(model)
    del tensors["lm_head.weight"]
    with pytest.warns(UserWarning, match="no 'lm_head.weight'"):
        params, cfg = params_from_hf(tensors, hf_cfg(model, tie_word_embeddings=False), jnp.float32)
    assert cfg.tie_word_embeddings and "lm_head" not in params
    assert_logits_match(model, params, cfg)


# ----------------------------------------------------------------------------- mapping errors
@pytest.fixture(scope="module")
def qwen3_state():
    model = make_hf_model("qwen3", seed=6)
    return hf_numpy_state(model), hf_cfg(model)


def test_every_hf_tensor_is_mapped_exactly_once(qwen3_state):
    tensors, cfg = qwen3_state
    params, _ = params_from_hf(tensors, cfg, jnp.float32)
    # FP8 block scales: tests/checkpoints/test_fp8_checkpoint.py; MoE: tests/models/test_moe.py
    dense = [r for r in HF_TO_PARAMS if not r.param.endswith("_scale")]
    dense = [r for r in dense if not r.per_expert and r.leaf != "router"]
    mapped = {r.hf_name.format(i=i) for r in dense for i in range(cfg.num_layers)}
    assert mapped >= set(tensors) - {"lm_head.weight"}
    for r in dense:
        for i in range(cfg.num_layers) if r.per_layer else [None]:
            got = params
            for key in r.param.format(i=i).split("/"):
                got = got[key]
            got = np.asarray(got)
            if r.part is not None:
                got = got[..., fused_parts(cfg)[r.leaf][r.part]]
            want = tensors[r.hf_name.format(i=i)]
            np.testing.assert_array_equal(got, want.T if r.transpose else want)


def test_fused_params_concatenate_hf_tensors_in_order(qwen3_state):
    """wqkv = [q_proj.T | k_proj.T | v_proj.T], w_gate_up = [gate_proj.T | up_proj.T]."""
    tensors, cfg = qwen3_state
    params, _ = params_from_hf(tensors, cfg, jnp.float32)
    t = "model.layers.1."
    wqkv = np.concatenate([tensors[t + f"self_attn.{n}_proj.weight"].T for n in "qkv"], axis=1)
    w_gate_up = np.concatenate(
        [tensors[t + f"mlp.{n}_proj.weight"].T for n in ("gate", "up")], axis=1
    )
    np.testing.assert_array_equal(np.asarray(params["layers"]["1"]["wqkv"]), wqkv)
    np.testing.assert_array_equal(np.asarray(params["layers"]["1"]["w_gate_up"]), w_gate_up)


def test_missing_tensor_is_named(qwen3_state):
    tensors, cfg = qwen3_state
    tensors = dict(tensors)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(ValueError, match=r"missing.*model\.layers\.1\.mlp\.up_proj\.weight"):
        params_from_hf(tensors, cfg, jnp.float32)


@pytest.mark.parametrize(
    "extra",
    [
        "model.layers.0.self_attn.q_proj.bias",  # not in the table
        "model.layers.2.input_layernorm.weight",  # layer index >= num_layers (2)
        "model.vision_tower.weight",  # foreign module
    ],
)
def test_unmapped_tensor_is_named(qwen3_state, extra):
    tensors, cfg = qwen3_state
    tensors = dict(tensors, **{extra: np.ones(64, np.float32)})
    with pytest.raises(ValueError, match=f"unexpected tensor '{extra}'"):
        params_from_hf(tensors, cfg, jnp.float32)


def test_qk_norm_tensor_in_llama_is_unmapped():
    model = make_hf_model("llama", seed=8)
    tensors = dict(hf_numpy_state(model))
    tensors["model.layers.0.self_attn.q_norm.weight"] = np.ones(16, np.float32)
    with pytest.raises(ValueError, match="q_norm"):
        params_from_hf(tensors, hf_cfg(model), jnp.float32)


def test_rotary_buffer_is_ignored(qwen3_state):
    tensors, cfg = qwen3_state
    extra = dict(tensors)
    extra["model.layers.0.self_attn.rotary_emb.inv_freq"] = np.ones(8, np.float32)
    extra["model.rotary_emb.inv_freq"] = np.ones(8, np.float32)
    p1, _ = params_from_hf(extra, cfg, jnp.float32)
    p0, _ = params_from_hf(tensors, cfg, jnp.float32)
    np.testing.assert_array_equal(
        np.asarray(p1["layers"]["0"]["wqkv"]), np.asarray(p0["layers"]["0"]["wqkv"])
    )


def test_duplicate_tensor_in_pairs(qwen3_state):
    tensors, cfg = qwen3_state
    pairs = list(tensors.items()) + [("model.norm.weight", tensors["model.norm.weight"])]
    with pytest.raises(ValueError, match=r"duplicate tensor 'model\.norm\.weight'"):
        params_from_hf(pairs, cfg, jnp.float32)


def test_wrong_shape_names_both_shapes(qwen3_state):
    tensors, cfg = qwen3_state
    tensors = dict(tensors)
    name = "model.layers.0.self_attn.k_proj.weight"  # HF [K*H, D] = (32, 64)
    tensors[name] = np.ascontiguousarray(tensors[name].T)  # (64, 32): the classic transpose bug
    with pytest.raises(ValueError, match=r"k_proj.*\(64, 32\).*expected \(32, 64\)"):
        params_from_hf(tensors, cfg, jnp.float32)


# ----------------------------------------------------------------------------- loader
def _write_dir(path, model, shards: dict[str, dict[str, np.ndarray]], index: dict | None):
    model.config.save_pretrained(path)
    for fname, t in shards.items():
        save_file(t, str(path / fname))
    if index is not None:
        (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": index}))


def test_duplicate_tensor_across_shards(tmp_path):
    model = make_hf_model("llama", seed=9)
    t = hf_numpy_state(model)
    names = sorted(t)
    a, b = names[: len(names) // 2], names[len(names) // 2 :]
    dup = "model.norm.weight" if "model.norm.weight" in a else a[0]
    shards = {
        "s1.safetensors": {n: t[n] for n in a},
        "s2.safetensors": {n: t[n] for n in b + [dup] if n in t},
    }
    index = {**{n: "s1.safetensors" for n in a}, **{n: "s2.safetensors" for n in b}}
    _write_dir(tmp_path, model, shards, index)
    with pytest.raises(ValueError, match=f"duplicate tensor '{dup}'.*s1.*s2"):
        load_params(tmp_path, jnp.float32)


def test_missing_paths_are_file_not_found(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope"):
        load_params(tmp_path / "nope", jnp.float32)
    model = make_hf_model("llama", seed=10)
    model.config.save_pretrained(tmp_path)
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_params(tmp_path, jnp.float32)
    t = hf_numpy_state(model)
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {n: "gone.safetensors" for n in t}})
    )
    with pytest.raises(FileNotFoundError, match="gone.safetensors"):
        load_params(tmp_path, jnp.float32)


def test_bf16_checkpoint(tmp_path):
    model = make_hf_model("qwen3", seed=11)
    model.to(torch.bfloat16).save_pretrained(tmp_path)
    cfg, p32 = load_params(tmp_path, jnp.float32)
    _, p16 = load_params(tmp_path, jnp.bfloat16)
    assert p16["embed"].dtype == jnp.bfloat16 and p32["embed"].dtype == jnp.float32
    want = model.model.layers[1].self_attn.q_proj.weight.detach().float().numpy().T
    q = fused_parts(cfg)["wqkv"]["q"]
    np.testing.assert_array_equal(np.asarray(p32["layers"]["1"]["wqkv"][:, q]), want)
    np.testing.assert_array_equal(
        np.asarray(p16["layers"]["1"]["wqkv"][:, q]).astype(np.float32), want
    )
    # The raw reader for safetensors builds without numpy bf16 reads the same bits.
    name = "model.layers.1.self_attn.q_proj.weight"
    raw = loader._read_raw(str(tmp_path / "model.safetensors"), name)
    np.testing.assert_array_equal(raw.astype(np.float32), want.T)
