"""`checkpoints_tools` imports no `jaxinfer` (the arrow is jaxinfer -> checkpoints_tools), and a
missing optional dependency gives an actionable error, not a traceback from transformers."""

import os
import pkgutil
import subprocess
import sys

import pytest

import checkpoints_tools

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_checkpoints_tools_imports_no_jaxinfer():
    names = ["checkpoints_tools"] + [f"checkpoints_tools.{m.name}"
                                     for m in pkgutil.iter_modules(checkpoints_tools.__path__)]
    assert "checkpoints_tools.loader" in names and "checkpoints_tools.mapping" in names
    code = ("import importlib, sys\n"
            f"for n in {names!r}: importlib.import_module(n)\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'jaxinfer'))")
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                       env=dict(os.environ, JAX_PLATFORMS="cpu"), timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


def test_gguf_tokenizer_without_torch_says_what_to_install(monkeypatch):
    import transformers

    from checkpoints_tools.default_model import default_model_path
    from checkpoints_tools.loader import load_tokenizer

    def no_torch(*a, **k):
        raise ModuleNotFoundError("No module named 'torch'")

    monkeypatch.setattr(transformers.PreTrainedTokenizerFast, "from_pretrained", no_torch)
    with pytest.raises(ValueError, match=r"jaxinfer\[gguf\]"):
        load_tokenizer(default_model_path())
