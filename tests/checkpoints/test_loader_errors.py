"""`checkpoints_tools` imports no `jaxinfer` (the arrow is jaxinfer -> checkpoints_tools), and a
missing optional dependency gives an actionable error, not a traceback from transformers."""

import os
import pkgutil
import subprocess
import sys

import pytest

import checkpoints_tools

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _python(code: str) -> str:
    """stdout of ``python -c code`` in a fresh process at the repository root (CPU JAX)."""
    r = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        capture_output=True,
        text=True,
        env=dict(os.environ, JAX_PLATFORMS="cpu"),
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_checkpoints_tools_imports_no_jaxinfer():
    names = ["checkpoints_tools"] + [
        f"checkpoints_tools.{m.name}" for m in pkgutil.iter_modules(checkpoints_tools.__path__)
    ]
    assert "checkpoints_tools.loader" in names and "checkpoints_tools.mapping" in names
    code = (
        "import importlib, sys\n"
        f"for n in {names!r}: importlib.import_module(n)\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'jaxinfer'))"
    )
    assert _python(code).strip() == "[]"


def test_gguf_tokenizer_without_torch_says_what_to_install(monkeypatch):
    import transformers

    from checkpoints_tools.default_model import default_model_path
    from checkpoints_tools.loader import load_tokenizer

    def no_torch(*a, **k):
        raise ModuleNotFoundError("No module named 'torch'")

    monkeypatch.setattr(transformers.PreTrainedTokenizerFast, "from_pretrained", no_torch)
    with pytest.raises(ValueError, match=r"jaxinfer\[gguf\]"):
        load_tokenizer(default_model_path())


def test_hf_dir_without_tokenizer_files_is_refused(tmp_path):
    """transformers 5's AutoTokenizer builds an empty one-token tokenizer from config.json alone;
    a model directory with no tokenizer file is refused, naming the files and the ways out
    (vLLM's ``tokenizer=`` and ``skip_tokenizer_init``)."""
    from checkpoints_tools.loader import load_tokenizer

    (tmp_path / "config.json").write_text('{"model_type": "qwen3"}')
    with pytest.raises(
        ValueError,
        match=r"no tokenizer \(none of tokenizer_config.json.*"
        r"tokenizer=DIR, or skip_tokenizer_init",
    ):
        load_tokenizer(tmp_path, "hf")


def test_saved_tokenizer_class_is_loaded_by_name_without_torch(tmp_path):
    """A tokenizer_config.json naming a transformers class loads that class (as AutoTokenizer
    would resolve it) without AutoTokenizer's imports, which pull in torch."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel({"a": 0, "b": 1}, unk_token="a")), unk_token="a"
    ).save_pretrained(tmp_path)
    cfg = tmp_path / "tokenizer_config.json"
    cfg.write_text(
        cfg.read_text()
        .replace('"TokenizersBackend"', '"Qwen2Tokenizer"')
        .replace('"PreTrainedTokenizerFast"', '"Qwen2Tokenizer"')
    )
    code = (
        "import sys; from checkpoints_tools.loader import load_tokenizer; "
        f"t = load_tokenizer({str(tmp_path)!r}, 'hf'); "
        "print(type(t).__name__, 'torch' in sys.modules)"
    )
    assert _python(code).split() == ["Qwen2Tokenizer", "False"]
