"""`checkpoints_tools.gguf_cache`: a GGUF file converted once into a directory in the user's
cache gives the same model on its next load (the reference: the first, uncached load from the GGUF
itself, which writes the entry): config, EOS ids, every param bit for bit (float32, and bfloat16
cast from the stored float32 tree), and a tokenizer that encodes, decodes and applies the chat
template the same. vLLM keeps no such cache; this is the fast second start of
``python -m jaxinfer.generate`` on the embedded GGUF."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from checkpoints_tools import gguf_cache
from checkpoints_tools.loader import open_checkpoint
from jaxinfer.config import ModelConfig
from jaxinfer.runner.loading import load_model, load_params

TEXTS = ["Hello, world!", "  two spaces\nand a newline", "日本語 and émojis 🙂", ""]


def _same_tokenizer(tok2, tok) -> None:
    for text in TEXTS:
        assert tok2.encode(text) == tok.encode(text)
        assert tok2.decode(tok.encode(text)) == tok.decode(tok.encode(text))
    chat = [{"role": "user", "content": "What is 2 + 2?"}]
    assert tok2.apply_chat_template(
        chat, tokenize=False, add_generation_prompt=True
    ) == tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert tok2.eos_token_id == tok.eos_token_id


def test_second_load_is_the_cached_param_tree_and_the_same_model(
    smollm_path, smollm_ckpt, tmp_path, monkeypatch
):
    """The first load converts the GGUF and writes the entry (replacing the HF-layout entry of
    layout 1, if any), its float32 leaves on the CPU the very arrays it stores (no copy); the
    second reads the param tree from it: the same model."""
    monkeypatch.setenv("JAXINFER_GGUF_CACHE", str(tmp_path))
    old = tmp_path / gguf_cache._key(smollm_path, 1)
    old.mkdir()
    (old / "model.safetensors").write_bytes(b"")  # layout 1: HF tensors, not read any more
    assert gguf_cache.pending(smollm_path) == gguf_cache.entry(smollm_path)  # the CLI says so
    stored, real_store = {}, gguf_cache.store

    def store(ckpt, tokenizer, flat, **kw):
        stored.update(flat)
        return real_store(ckpt, tokenizer, flat, **kw)

    monkeypatch.setattr(gguf_cache, "store", store)
    first = load_model(smollm_path, "float32")
    gguf_cache.join()  # the tensors are written in the background
    if jax.default_backend() == "cpu":
        paths = {"/".join(k.key for k in p): a for p, a in jax.tree.leaves_with_path(first.params)}
        assert paths.keys() == stored.keys()
        assert all(a.unsafe_buffer_pointer() == stored[k].ctypes.data for k, a in paths.items())
    assert gguf_cache.pending(smollm_path) is None and not old.exists()
    cached = open_checkpoint(smollm_path)
    assert cached.format == "hf" and cached.path == gguf_cache.entry(smollm_path)
    assert os.path.dirname(cached.path) == str(tmp_path)
    assert ModelConfig.from_checkpoint(cached) == ModelConfig.from_checkpoint(smollm_ckpt)
    assert cached.generation_eos_ids == smollm_ckpt.generation_eos_ids
    again = load_model(smollm_path, "float32")
    assert again.config == first.config and again.eos_token_ids == first.eos_token_ids
    same = jax.tree.map(
        lambda a, b: a.dtype == b.dtype and np.array_equal(a, b), again.params, first.params
    )
    assert jax.tree.structure(again.params) == jax.tree.structure(first.params)
    assert all(jax.tree.leaves(same))
    _same_tokenizer(again.tokenizer, first.tokenizer)
    _, bf16 = load_params(cached, "bfloat16")  # cast from the stored float32 tree
    assert all(
        jax.tree.leaves(
            jax.tree.map(lambda a, b: np.array_equal(a, b.astype(jnp.bfloat16)), bf16, first.params)
        )
    )


def test_an_entry_that_does_not_fit_names_the_directory(smollm_path, tmp_path, monkeypatch):
    """A stored tree with a missing leaf, or a params file of another format, is a ValueError
    naming the entry to delete; a directory without the file is no entry."""
    monkeypatch.setenv("JAXINFER_GGUF_CACHE", str(tmp_path))
    d = tmp_path / "entry"
    d.mkdir()
    assert gguf_cache.read_params(str(d)) is None
    (d / "config.json").write_text(json.dumps(open_checkpoint(smollm_path).config))
    gguf_cache.write_params(
        str(d / gguf_cache.PARAMS_FILE), {"embed": np.zeros((2, 2), np.float32)}
    )
    with pytest.raises(ValueError, match="does not fit.*delete that directory"):
        load_params(str(d), "float32")
    from safetensors.numpy import save_file

    save_file({"embed": np.zeros((2, 2), np.float32)}, str(d / gguf_cache.PARAMS_FILE))
    with pytest.raises(ValueError, match=f"is not a layout-{gguf_cache.LAYOUT}.*delete"):
        gguf_cache.read_params(str(d))


def test_off_and_keyed_by_the_file(tmp_path, monkeypatch):
    """ "0" turns the cache off; a changed file (size or mtime) gets another entry; only a .gguf
    file that exists is ever pending."""
    f = tmp_path / "m.gguf"
    f.write_bytes(b"x")
    monkeypatch.setenv("JAXINFER_GGUF_CACHE", "0")
    assert gguf_cache.entry(str(f)) is None and gguf_cache.lookup(str(f)) is None
    assert gguf_cache.pending(str(f)) is None
    monkeypatch.setenv("JAXINFER_GGUF_CACHE", str(tmp_path / "c"))
    before = gguf_cache.entry(str(f))
    assert before.startswith(str(tmp_path / "c")) and gguf_cache.lookup(str(f)) is None
    assert gguf_cache.pending(str(f)) == before
    assert gguf_cache.pending(str(tmp_path / "none.gguf")) is None
    assert gguf_cache.pending(str(tmp_path)) is None  # a directory: an HF or Orbax model
    f.write_bytes(b"xy")
    assert gguf_cache.entry(str(f)) != before
