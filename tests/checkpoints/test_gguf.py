"""GGUF loading against HF transformers' own GGUF loader (the independent reference).

Real weights: SmolLM2-135M-Instruct Q4_1 (llama architecture, Q/K rows permuted by llama.cpp).
Every dequantised tensor, renamed and un-permuted, must equal HF's tensor (same gguf dequantiser);
the param tree, mapped back to HF names/layout by a table written here, must equal it too; and the
prefill logits of a short prompt through the paged-KV model must match HF's float32 forward.

Synthetic GGUFs (written with ``gguf.GGUFWriter``): a tiny random Qwen3 (not permuted by llama.cpp)
read back by both HF and us; Llama 3 RoPE factors (``rope_freqs``) recovered into a config whose
frequencies equal HF's llama3 RoPE; an unsupported architecture and an unknown tensor name fail.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from checkpoints_tools.gguf_loader import gguf_hf_config, open_gguf, unpermute_qk  # noqa: E402
from checkpoints_tools.loader import hf_tensors, open_checkpoint  # noqa: E402
from jaxinfer import models  # noqa: E402
from jaxinfer.config import ModelConfig  # noqa: E402
from jaxinfer.models.kv_cache import init_kv_cache  # noqa: E402
from jaxinfer.runner.loading import load_params, params_from_hf  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")
PAGE_SIZE = 16

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


def load_gguf_hf(path) -> tuple[dict, dict[str, np.ndarray]]:
    """(HF-style config dict, {HF name: f32 array}) of a GGUF file."""
    ckpt = open_checkpoint(path)
    return ckpt.config, dict(hf_tensors(ckpt))


def hf_state(model) -> dict[str, np.ndarray]:
    return {k: v.detach().float().numpy() for k, v in model.state_dict().items()}


def paged_prefill_logits(params, cfg: ModelConfig, tokens: list[int]) -> np.ndarray:
    """f32[T, V] logits of one prompt through models.forward over a fresh paged KV cache
    (pages assigned in reverse order so the block table is not the identity)."""
    T = len(tokens)
    n_pages = -(-T // PAGE_SIZE)
    kv = init_kv_cache(cfg, n_pages + 2, PAGE_SIZE, jnp.float32)
    pages = np.arange(n_pages + 1, 1, -1, dtype=np.int32)  # never page 0
    pos = np.arange(T, dtype=np.int32)
    slots = pages[pos // PAGE_SIZE] * PAGE_SIZE + pos % PAGE_SIZE
    kv = kv.replace(block_tables=jnp.asarray(pages[None]), seq_lens=jnp.asarray([T], jnp.int32))

    @jax.jit
    def run(params, tok, pos, slots, kv):
        hidden, _ = models.forward(params, cfg, tok, pos, slots, kv)
        return models.compute_logits(params, cfg, hidden)

    with jax.default_matmul_precision("highest"):  # f32 reference: no TF32 on GPUs
        out = run(
            params,
            jnp.asarray([tokens], jnp.int32),
            jnp.asarray(pos[None]),
            jnp.asarray(slots[None]),
            kv,
        )
    return np.asarray(out[0], np.float32)


def rel_err(a, b) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


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


# ----------------------------------------------------------------------------- synthetic GGUFs
def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf ``LlamaModel.permute`` (HF half-split -> interleaved rows)."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


@pytest.mark.parametrize("n_head", [1, 3, 8])
def test_unpermute_inverts_llama_cpp_permute(n_head):
    w = np.random.default_rng(n_head).standard_normal((n_head * 16, 24)).astype(np.float32)
    p = llama_cpp_permute(w, n_head)
    assert not np.array_equal(p, w)
    np.testing.assert_array_equal(unpermute_qk(p, n_head), w)


HF_TO_GGUF_LAYER = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
HF_TO_GGUF_GLOBAL = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


def write_gguf(path, arch: str, hf: dict, tensors: dict[str, np.ndarray], extra=()) -> None:
    """A minimal GGUF: ``arch`` metadata from the HF-style dict ``hf`` plus float32 tensors."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(hf["num_hidden_layers"])
    w.add_context_length(hf["max_position_embeddings"])
    w.add_embedding_length(hf["hidden_size"])
    w.add_feed_forward_length(hf["intermediate_size"])
    w.add_head_count(hf["num_attention_heads"])
    w.add_head_count_kv(hf["num_key_value_heads"])
    w.add_key_length(hf["head_dim"])
    w.add_value_length(hf["head_dim"])
    w.add_rope_dimension_count(hf["head_dim"])
    w.add_rope_freq_base(hf["rope_theta"])
    w.add_layer_norm_rms_eps(hf["rms_norm_eps"])
    w.add_vocab_size(hf["vocab_size"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    for name, arr in list(tensors.items()) + list(extra):
        w.add_tensor(name, np.ascontiguousarray(arr, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def hf_state_to_gguf(state: dict[str, np.ndarray], permute_heads=None) -> dict[str, np.ndarray]:
    """Rename an HF state dict to GGUF names (llama.cpp's convention), permuting q/k if asked."""
    out = {}
    for k, v in state.items():
        if k in HF_TO_GGUF_GLOBAL:
            out[HF_TO_GGUF_GLOBAL[k]] = v
            continue
        parts = k.split(".")
        mid = ".".join(parts[3:-1])
        if permute_heads and mid in ("self_attn.q_proj", "self_attn.k_proj"):
            v = llama_cpp_permute(v, permute_heads["q" if mid.endswith("q_proj") else "k"])
        out[f"blk.{parts[2]}.{HF_TO_GGUF_LAYER[mid]}.weight"] = v
    return out


TINY = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=128,
    rms_norm_eps=1e-6,
    max_position_embeddings=256,
    rope_theta=1e6,
    tie_word_embeddings=False,
)


def random_hf_model(arch: str, seed: int = 0):
    cls = {
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
    }[arch]
    kw = dict(TINY)
    theta = kw.pop("rope_theta")
    torch.manual_seed(seed)
    model = cls[1](
        cls[0](rope_parameters={"rope_type": "default", "rope_theta": theta}, **kw)
    ).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1.0 + 0.2 * noise if name.endswith("norm.weight") else 0.15 * noise)
    return model


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_tiny_gguf_matches_hf(arch, tmp_path):
    """HF's GGUF loader and ours read the same synthetic file to the same tensors and logits.

    Qwen3: written unpermuted (as llama.cpp does); llama: q/k permuted with llama.cpp's formula.
    head_dim=128 because HF's qwen3 GGUF config mapping ignores key_length (Qwen3 default 128).
    """
    model = random_hf_model(arch, seed=7)
    state = hf_state(model)
    perm = {"q": TINY["num_attention_heads"], "k": TINY["num_key_value_heads"]}
    write_gguf(
        tmp_path / "m.gguf", arch, TINY, hf_state_to_gguf(state, perm if arch == "llama" else None)
    )
    hf_from_gguf = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, gguf_file="m.gguf", dtype=torch.float32
    ).eval()
    hf_ref = hf_state(hf_from_gguf)
    for k in state:  # HF's reader agrees with the weights we wrote
        np.testing.assert_array_equal(hf_ref[k], state[k])

    hf_cfg, tensors = load_gguf_hf(tmp_path / "m.gguf")
    assert set(tensors) == set(state)
    for k in state:
        np.testing.assert_array_equal(tensors[k], hf_ref[k])
    cfg, params = load_params(tmp_path / "m.gguf", jnp.float32)
    assert cfg.architecture == arch and cfg.qk_norm == (arch == "qwen3")
    assert cfg.tie_word_embeddings is False and cfg.head_dim == 128
    ids = np.random.default_rng(1).integers(0, TINY["vocab_size"], size=21).tolist()
    with torch.no_grad():
        ref = hf_from_gguf(torch.tensor([ids])).logits[0].numpy()
    assert rel_err(paged_prefill_logits(params, cfg, ids), ref) < 1e-4
    # a bf16 load (cast per tensor while reading) equals the f32 load cast afterwards
    _, p16 = load_params(tmp_path / "m.gguf", jnp.bfloat16)
    for a, b in zip(jax.tree_util.tree_leaves(p16), jax.tree_util.tree_leaves(params)):
        assert a.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b.astype(jnp.bfloat16)))


@pytest.mark.parametrize("factor,theta", [(8.0, 500000.0), (32.0, 500000.0)])
def test_llama3_rope_freqs_recovered(factor, theta, tmp_path):
    """``rope_freqs.weight`` (llama.cpp's Llama 3 factors) -> a RopeScaling whose HF llama3
    inverse frequencies equal the ones the factors were made from."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    head_dim = 128
    rope = {
        "rope_type": "llama3",
        "rope_theta": theta,
        "factor": factor,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }

    def hf_inv_freq(rope_parameters):
        c = transformers.LlamaConfig(
            hidden_size=256,
            num_attention_heads=2,
            head_dim=head_dim,
            rope_parameters=rope_parameters,
        )
        return ROPE_INIT_FUNCTIONS["llama3"](c, "cpu")[0].double().numpy()

    base = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    factors = (base / hf_inv_freq(rope)).astype(np.float32)  # what llama.cpp stores
    assert factors.min() == pytest.approx(1.0) and factors.max() == pytest.approx(factor)
    hf = dict(TINY, head_dim=head_dim, rope_theta=theta)
    write_gguf(tmp_path / "r.gguf", "llama", hf, {}, extra=[("rope_freqs.weight", factors)])
    cfg = ModelConfig.from_hf_config(gguf_hf_config(open_gguf(tmp_path / "r.gguf")))
    s = cfg.rope_scaling
    assert s is not None and s.factor == pytest.approx(factor)
    got = hf_inv_freq(
        {
            "rope_type": "llama3",
            "rope_theta": cfg.rope_theta,
            "factor": s.factor,
            "low_freq_factor": s.low_freq_factor,
            "high_freq_factor": s.high_freq_factor,
            "original_max_position_embeddings": s.original_max_position_embeddings,
        }
    )
    np.testing.assert_allclose(got, hf_inv_freq(rope), rtol=1e-5)


def test_rope_freqs_all_ones_means_no_scaling(tmp_path):
    write_gguf(
        tmp_path / "r.gguf",
        "llama",
        TINY,
        {},
        extra=[("rope_freqs.weight", np.ones(TINY["head_dim"] // 2, np.float32))],
    )
    assert "rope_scaling" not in gguf_hf_config(open_gguf(tmp_path / "r.gguf"))


def test_unsupported_architecture_is_named(tmp_path):
    write_gguf(tmp_path / "g.gguf", "gpt2", TINY, {"token_embd.weight": np.ones((128, 64))})
    with pytest.raises(ValueError, match=r"'gpt2'.*\('llama', 'qwen3'\)"):
        load_params(tmp_path / "g.gguf", jnp.float32)


def test_unknown_tensor_is_an_error(tmp_path):
    model_state = hf_state(random_hf_model("llama", seed=2))
    tensors = hf_state_to_gguf(model_state)
    tensors["blk.0.attn_qkv.weight"] = np.ones((4, 64), np.float32)
    write_gguf(tmp_path / "u.gguf", "llama", TINY, tensors)
    with pytest.raises(ValueError, match="blk.0.attn_qkv.weight"):
        load_params(tmp_path / "u.gguf", jnp.float32)


def test_missing_file_and_bad_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.gguf"):
        load_params(tmp_path / "nope.gguf", jnp.float32)
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf file at all")
    with pytest.raises(ValueError, match="junk.gguf"):
        load_params(tmp_path / "junk.gguf", jnp.float32)


@pytest.mark.parametrize("size", [24, 100, 1000, 5000, 200_000])
def test_gguf_cut_inside_its_metadata_is_a_value_error(smollm_path, tmp_path, size):
    """Whatever gguf-py's parse hits first (struct, index or dtype errors) is one ValueError
    naming the file."""
    from checkpoints_tools.loader import open_checkpoint

    cut = tmp_path / "cut.gguf"
    with open(smollm_path, "rb") as f:
        cut.write_bytes(f.read(size))
    with pytest.raises(ValueError, match="cut.gguf.* is not a readable GGUF file"):
        open_checkpoint(cut)
