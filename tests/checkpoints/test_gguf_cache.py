"""`checkpoints_tools.gguf_cache`: a GGUF file converted once into an HF directory in the user's
cache gives the same model on its next open (the reference: the first, uncached load from the
GGUF itself): config, EOS ids, every param bit for bit, and a tokenizer that encodes, decodes and
applies the chat template the same. vLLM keeps no such cache; this is the fast second start of
``python -m jaxinfer.generate`` on the embedded GGUF."""

import os

import numpy as np

from checkpoints_tools import gguf_cache
from checkpoints_tools.loader import hf_tensors, load_tokenizer, open_checkpoint
from jaxinfer.config import ModelConfig

TEXTS = ["Hello, world!", "  two spaces\nand a newline", "日本語 and émojis 🙂", ""]


def test_second_open_is_the_cached_hf_dir_and_the_same_model(
    smollm_path, smollm_ckpt, smollm_hf_named, tmp_path, monkeypatch
):
    monkeypatch.setenv("JAXINFER_GGUF_CACHE", str(tmp_path))
    tok = load_tokenizer(smollm_ckpt)  # the GGUF's, converted by transformers
    assert gguf_cache.pending(smollm_path) == gguf_cache.entry(smollm_path)  # the CLI says so
    assert gguf_cache.store(smollm_ckpt, tok) == gguf_cache.entry(smollm_path)
    assert gguf_cache.pending(smollm_path) is None
    cached = open_checkpoint(smollm_path)
    assert cached.format == "hf" and cached.path == gguf_cache.entry(smollm_path)
    assert os.path.dirname(cached.path) == str(tmp_path)
    assert ModelConfig.from_checkpoint(cached) == ModelConfig.from_checkpoint(smollm_ckpt)
    assert cached.generation_eos_ids == smollm_ckpt.generation_eos_ids
    ref = smollm_hf_named[1]
    got = dict(hf_tensors(cached))
    assert sorted(got) == sorted(ref)
    assert all(got[k].dtype == ref[k].dtype and np.array_equal(got[k], ref[k]) for k in ref)
    tok2 = load_tokenizer(cached)
    for text in TEXTS:
        assert tok2.encode(text) == tok.encode(text)
        assert tok2.decode(tok.encode(text)) == tok.decode(tok.encode(text))
    chat = [{"role": "user", "content": "What is 2 + 2?"}]
    assert tok2.apply_chat_template(
        chat, tokenize=False, add_generation_prompt=True
    ) == tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert tok2.eos_token_id == tok.eos_token_id


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
