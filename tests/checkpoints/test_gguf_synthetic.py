"""GGUF loading on synthetic GGUFs (written with ``gguf.GGUFWriter``), against HF transformers'
own GGUF loader: a tiny random Qwen3 (not permuted by llama.cpp) and Llama read back by both HF and
us; llama.cpp's Q/K permutation undone; Llama 3 RoPE factors (``rope_freqs``) recovered into a
config whose frequencies equal HF's llama3 RoPE; an unsupported architecture, an unknown tensor
name, a missing or bad file fail with a clear error; metadata arrays read as gguf's own reader
reads them.
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
from jaxinfer.config import ModelConfig  # noqa: E402
from jaxinfer.runner.loading import load_params  # noqa: E402

from .gguf_refs import hf_state, load_gguf_hf, paged_prefill_logits, rel_err  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")


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


def test_metadata_arrays_read_as_gguf_reads_them(tmp_path):
    """`open_gguf`'s reader splits arrays of strings and scalars in one loop: the same fields
    (offsets, parts, data indices, types, contents) as ``gguf.GGUFReader``'s, empty and nested
    arrays included; a file cut inside an array is an error naming it."""
    path = tmp_path / "arrays.gguf"
    w = gguf.GGUFWriter(path, "llama")
    w.add_array("a.strings", ["x", "", "héllo", "z" * 300])
    for key, values in (("empty", []), ("ints", [1, 2, 3]), ("floats", [1.5, -2.0])):
        w.add_array(f"a.{key}", values)
    w.add_array("a.bools", [True, False])
    w.add_array("a.nested", [[1, 2], [3]])
    w.add_string("a.string", "plain")
    w.add_tensor("t", np.arange(8, dtype=np.float32))
    for write in (w.write_header_to_file, w.write_kv_data_to_file, w.write_tensors_to_file):
        write()
    w.close()
    ours, theirs = open_gguf(path).fields, gguf.GGUFReader(path).fields
    assert ours.keys() == theirs.keys()
    for f, g in zip(ours.values(), theirs.values()):
        assert (f.offset, f.data, f.types, f.contents()) == (
            g.offset,
            g.data,
            g.types,
            g.contents(),
        )
        assert [(p.dtype, p.tolist()) for p in f.parts] == [(p.dtype, p.tolist()) for p in g.parts]
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(path.read_bytes()[: ours["a.strings"].offset + 40])
    with pytest.raises(ValueError, match="cut.gguf.* is not a readable GGUF file"):
        open_gguf(cut)
