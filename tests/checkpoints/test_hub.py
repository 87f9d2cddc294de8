"""Hugging Face hub ids (`checkpoints_tools.hub`), offline: a temporary cache in the hub's layout
(``models--org--name/snapshots/<commit>/``, ``refs/main``) holds the tiny checkpoint and its
tokenizer; `LLM`, `LLM.from_params` and the CLI resolve ids from it with ``HF_HUB_OFFLINE=1``
(conftest sets it for the run) and ``HF_HUB_CACHE`` / ``HF_HOME`` / ``download_dir`` pointing
there; an id not in the cache is one clear error naming it. Nothing downloads."""

import os
import shutil

import pytest

from checkpoints_tools.hub import resolve_path
from jaxinfer import LLM, SamplingParams

COMMIT = "0123456789abcdef0123456789abcdef01234567"
ENGINE = dict(dtype="float32", max_model_len=64, page_size=16, num_pages=8, max_num_seqs=1)


def _snapshot(cache, repo: str, src: str, commit: str = COMMIT, ref: str = "main") -> str:
    """Copy ``src`` into ``cache`` as snapshot ``commit`` of ``repo`` (``refs/ref`` names it)."""
    root = cache / ("models--" + repo.replace("/", "--"))
    snap = root / "snapshots" / commit
    shutil.copytree(src, snap)
    (root / "refs").mkdir(exist_ok=True)
    (root / "refs" / ref).write_text(commit)
    return str(snap)


@pytest.fixture(scope="module")
def hub_cache(tiny_checkpoint, tmp_path_factory):
    """(cache dir, model snapshot, tokenizer snapshot): ``jaxinfer-tests/tiny`` (the Orbax tiny
    checkpoint) and ``jaxinfer-tests/tiny-tokenizer`` (its HF tokenizer files)."""
    cache = tmp_path_factory.mktemp("hf-home") / "hub"
    cache.mkdir()
    model = _snapshot(cache, "jaxinfer-tests/tiny", tiny_checkpoint)
    tok = _snapshot(
        cache, "jaxinfer-tests/tiny-tokenizer", os.path.join(tiny_checkpoint, "tokenizer")
    )
    return str(cache), model, tok


@pytest.fixture
def offline(hub_cache, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", hub_cache[0])
    return hub_cache


def test_resolve_path_cache_locations(hub_cache, monkeypatch):
    """A local path as it is; a hub id in ``$HF_HUB_CACHE``, ``$HF_HOME/hub`` or ``download_dir``
    (first found wins), at ``refs/main`` or a commit id; offline, an id or revision not cached
    is the hub's error with the id, the revision and the cache named."""
    cache, model, _ = hub_cache
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    assert resolve_path(model) == model
    monkeypatch.setenv("HF_HOME", os.path.dirname(cache))
    assert resolve_path("jaxinfer-tests/tiny") == model
    assert resolve_path("jaxinfer-tests/tiny", revision=COMMIT) == model
    monkeypatch.setenv("HF_HOME", "/nonexistent")
    assert resolve_path("jaxinfer-tests/tiny", download_dir=cache) == model
    monkeypatch.setenv("HF_HUB_CACHE", cache)
    assert resolve_path("jaxinfer-tests/tiny") == model
    with pytest.raises(FileNotFoundError) as e:
        resolve_path("jaxinfer-tests/tiny", revision="v9")
    msg = str(e.value)
    assert "revision 'v9' of Hugging Face hub id 'jaxinfer-tests/tiny'" in msg, msg
    assert "HF_HUB_OFFLINE=1" in msg and cache in msg and "LocalEntryNotFoundError" in msg
    with pytest.raises(FileNotFoundError, match="tokenizer 'no/such/path' does not exist: no"):
        resolve_path("no/such/path", what="tokenizer")


def test_llm_of_a_hub_id_offline(offline, tiny_checkpoint):
    """``LLM("org/name")`` loads the cached snapshot and generates as the same checkpoint by
    path; a ``tokenizer`` hub id loads that tokenizer (``tokenizer_revision`` its commit)."""
    _, model, _ = offline
    sp = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    llm = LLM("jaxinfer-tests/tiny", **ENGINE)
    assert llm.model_path == model
    by_path = LLM(tiny_checkpoint, **ENGINE)
    assert llm.generate("abc", sp)[0].token_ids == by_path.generate("abc", sp)[0].token_ids
    other = LLM.from_params(
        llm.engine.model_config,
        llm.engine.runner.params,
        tokenizer="jaxinfer-tests/tiny-tokenizer",
        tokenizer_revision=COMMIT,
        **ENGINE,
    )
    assert other.get_tokenizer().encode("abc") == llm.get_tokenizer().encode("abc")


def test_missing_hub_id_offline_is_one_clear_error(offline):
    """An id not in the cache: FileNotFoundError naming it (model and tokenizer), before any
    weights are read."""
    with pytest.raises(FileNotFoundError, match=r"model 'jaxinfer-tests/absent' is no local path"):
        LLM("jaxinfer-tests/absent", **ENGINE)
    with pytest.raises(
        FileNotFoundError, match=r"tokenizer 'jaxinfer-tests/absent' is no local path, and .*"
    ):
        LLM("jaxinfer-tests/tiny", tokenizer="jaxinfer-tests/absent", **ENGINE)


def test_cli_hub_id_offline(offline, capsys):
    """``python -m jaxinfer.generate --model org/name``: generates from the cache; an absent id
    is one stderr line and exit code 2."""
    from jaxinfer.generate import main

    flags = ["--dtype", "float32", "--max-model-len", "64", "--num-pages", "8", "--max-tokens"]
    assert main(["--model", "jaxinfer-tests/tiny", "--prompt", "abc", *flags, "3"]) == 0
    capsys.readouterr()
    code = main(["--model", "jaxinfer-tests/absent", "--revision", "v2", "--prompt", "x"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith("error: model 'jaxinfer-tests/absent' is no local path, and ")
    assert "revision 'v2' of Hugging Face hub id 'jaxinfer-tests/absent'" in err[0]
