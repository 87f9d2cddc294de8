"""A missing optional dependency gives an actionable error, not a traceback from transformers."""

import pytest


def test_gguf_tokenizer_without_torch_says_what_to_install(monkeypatch):
    import transformers

    from checkpoints_tools.default_model import default_model_path
    from checkpoints_tools.loader import load_tokenizer

    def no_torch(*a, **k):
        raise ModuleNotFoundError("No module named 'torch'")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", no_torch)
    with pytest.raises(ValueError, match=r"jaxinfer\[gguf\]"):
        load_tokenizer(default_model_path())
