"""GGUF loading against HF transformers' own GGUF loader (the independent reference), on real
weights: SmolLM2-135M-Instruct Q4_1 (llama architecture, Q/K rows permuted by llama.cpp).

Every dequantised tensor, renamed and un-permuted, must equal HF's tensor (same gguf dequantiser);
the param tree, mapped back to HF names/layout by a table written here, must equal it too; and the
prefill logits of a short prompt through the paged-KV model must match HF's float32 forward. A
file cut inside its metadata is one ValueError. Synthetic GGUFs: test_gguf_synthetic.py.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

import jax.numpy as jnp  # noqa: E402

from checkpoints_tools.loader import open_checkpoint  # noqa: E402
from jaxinfer.config import ModelConfig  # noqa: E402
from jaxinfer.runner.loading import params_from_hf  # noqa: E402

from .gguf_refs import PAGE_SIZE, hf_state, paged_prefill_logits, rel_err  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")

# Our tree -> HF (name template, transposed?) per layer entry; fused entries list their parts in
# output-axis order with each part's width. Written independently of the loader's tables.
TREE_TO_HF = {
    "attn_norm": ("model.layers.{i}.input_layernorm.weight", False),
    "wo": ("model.layers.{i}.self_attn.o_proj.weight", True),
    "q_norm": ("model.layers.{i}.self_attn.q_norm.weight", False),
    "k_norm": ("model.layers.{i}.self_attn.k_norm.weight", False),
    "mlp_norm": ("model.layers.{i}.post_attention_layernorm.weight", False),
    "w_down": ("model.layers.{i}.mlp.down_proj.weight", True),
}
FUSED_TO_HF = {
    "wqkv": (
        ("model.layers.{i}.self_attn.q_proj.weight", lambda c: c.num_heads * c.head_dim),
        ("model.layers.{i}.self_attn.k_proj.weight", lambda c: c.num_kv_heads * c.head_dim),
        ("model.layers.{i}.self_attn.v_proj.weight", lambda c: c.num_kv_heads * c.head_dim),
    ),
    "w_gate_up": (
        ("model.layers.{i}.mlp.gate_proj.weight", lambda c: c.intermediate_size),
        ("model.layers.{i}.mlp.up_proj.weight", lambda c: c.intermediate_size),
    ),
}


def tree_as_hf(params, cfg: ModelConfig) -> dict[str, np.ndarray]:
    out = {
        "model.embed_tokens.weight": np.asarray(params["embed"]),
        "model.norm.weight": np.asarray(params["final_norm"]),
    }
    if "lm_head" in params:
        out["lm_head.weight"] = np.asarray(params["lm_head"]).T
    assert sorted(params["layers"], key=int) == [str(i) for i in range(cfg.num_layers)]
    for i in range(cfg.num_layers):
        layer = {k: np.asarray(v) for k, v in params["layers"][str(i)].items()}
        for key, (tmpl, transpose) in TREE_TO_HF.items():
            if key in layer:
                out[tmpl.format(i=i)] = layer[key].T if transpose else layer[key]
        for key, parts in FUSED_TO_HF.items():
            start = 0
            for tmpl, width in parts:
                out[tmpl.format(i=i)] = layer[key][:, start : start + width(cfg)].T
                start += width(cfg)
            assert start == layer[key].shape[1]
    return out


# ----------------------------------------------------------------------------- real SmolLM2 GGUF
@pytest.fixture(scope="module")
def hf_gguf_model(hf_smollm):
    return hf_smollm  # tests/conftest.py: loaded once for the whole run


@pytest.fixture(scope="module")
def smollm_loaded(smollm_hf_named):
    hf_cfg, tensors = smollm_hf_named
    params, cfg = params_from_hf(tensors, ModelConfig.from_hf_config(hf_cfg), jnp.float32)
    return cfg, params


def test_smollm_config_matches_hf(smollm_loaded, hf_gguf_model):
    cfg, _ = smollm_loaded
    ref = hf_gguf_model.config
    assert cfg.architecture == ref.model_type == "llama"
    assert (cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size, cfg.num_layers) == (
        ref.vocab_size,
        ref.hidden_size,
        ref.intermediate_size,
        ref.num_hidden_layers,
    )
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (
        ref.num_attention_heads,
        ref.num_key_value_heads,
        ref.head_dim,
    )
    assert cfg.rms_norm_eps == pytest.approx(ref.rms_norm_eps, rel=1e-7)
    assert cfg.rope_theta == ref.rope_parameters["rope_theta"]
    assert cfg.rope_scaling is None and ref.rope_parameters["rope_type"] == "default"
    assert cfg.max_position_embeddings == ref.max_position_embeddings
    assert cfg.tie_word_embeddings is True and ref.tie_word_embeddings is True
    assert cfg.bos_token_id == ref.bos_token_id
    assert cfg.eos_token_ids == (ref.eos_token_id,)


def test_smollm_tensors_match_hf_gguf_loader(
    smollm_ckpt, smollm_hf_named, smollm_loaded, hf_gguf_model
):
    """Renamed + un-permuted tensors, and the param tree mapped back, equal HF's tensors."""
    cfg, params = smollm_loaded
    ref = hf_state(hf_gguf_model)
    ref.pop("lm_head.weight")  # tied: HF lists the embedding twice
    _, tensors = smollm_hf_named
    assert set(tensors) == set(ref)
    worst = max(float(np.max(np.abs(tensors[k] - ref[k]))) for k in ref)
    assert worst <= 1e-6, worst
    ours = tree_as_hf(params, cfg)
    assert set(ours) == set(ref)
    worst = max(float(np.max(np.abs(ours[k] - ref[k]))) for k in ref)
    assert worst <= 1e-6, worst
    # The un-permutation mattered: the raw GGUF rows differ from HF's q_proj.
    t = {x.name: x for x in smollm_ckpt.reader.tensors}["blk.0.attn_q.weight"]
    raw = gguf.quants.dequantize(t.data, t.tensor_type)
    assert np.max(np.abs(raw - ref["model.layers.0.self_attn.q_proj.weight"])) > 0.1


def test_smollm_prefill_logits_match_hf(smollm_loaded, hf_gguf_model):
    cfg, params = smollm_loaded
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, size=PAGE_SIZE + 5).tolist()
    with torch.no_grad():
        ref = hf_gguf_model(torch.tensor([ids])).logits[0].float().numpy()
    ours = paged_prefill_logits(params, cfg, ids)  # spans two pages
    assert ours.shape == ref.shape
    assert rel_err(ours, ref) < 1e-4


@pytest.mark.parametrize("size", [24, 100, 1000, 5000, 200_000])
def test_gguf_cut_inside_its_metadata_is_a_value_error(smollm_path, tmp_path, size):
    """Whatever gguf-py's parse hits first (struct, index or dtype errors) is one ValueError
    naming the file."""

    cut = tmp_path / "cut.gguf"
    with open(smollm_path, "rb") as f:
        cut.write_bytes(f.read(size))
    with pytest.raises(ValueError, match="cut.gguf.* is not a readable GGUF file"):
        open_checkpoint(cut)
