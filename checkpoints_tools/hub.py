"""A model or tokenizer reference -> a local path, the one place this happens (`LLM`, the CLI and
the server go through it): `resolve_path`. A path that exists is taken as it is; anything else is
a Hugging Face hub id fetched with ``huggingface_hub.snapshot_download``, as vLLM does: into
``download_dir``, else ``$HF_HUB_CACHE``, else ``$HF_HOME/hub`` (the hub's default cache), at
``revision``, with ``token``; with ``HF_HUB_OFFLINE=1`` from that cache only (no network)."""

import os

# the files fetched: configs, safetensors weights, tokenizers (no *.bin / *.pt / ONNX copies)
MODEL_FILES = ("*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken")
TOKENIZER_FILES = ("*.json", "*.model", "*.txt", "*.jinja", "*.tiktoken")
_TRUE = ("1", "ON", "YES", "TRUE")  # huggingface_hub's spelling of a true environment flag


def hub_offline() -> bool:
    """Whether ``HF_HUB_OFFLINE`` is set true now (read at each call, not at import)."""
    return os.environ.get("HF_HUB_OFFLINE", "").upper() in _TRUE


def hub_cache_dir(download_dir: str | os.PathLike | None = None) -> str | None:
    """The cache a hub id resolves in: ``download_dir`` (vLLM's), ``$HF_HUB_CACHE``,
    ``$HF_HOME/hub``, or None (huggingface_hub's default, ``~/.cache/huggingface/hub``)."""
    if download_dir is not None:
        return os.fspath(download_dir)
    if cache := os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE"):
        return cache
    home = os.environ.get("HF_HOME")
    return os.path.join(home, "hub") if home else None


def resolve_path(
    ref: str | os.PathLike,
    *,
    what: str = "model",
    revision: str | None = None,
    download_dir: str | os.PathLike | None = None,
    token: str | bool | None = None,
) -> str:
    """``ref`` if it exists locally, else the local snapshot directory of hub id ``ref`` (the
    weights, configs and tokenizer files of ``MODEL_FILES``; ``what="tokenizer"``: only
    ``TOKENIZER_FILES``), downloaded unless offline. ``what`` names the argument in errors.
    FileNotFoundError, one message naming ``ref``: no such path and not a hub id, or the hub's
    own error (offline and not in the cache, no such repository or revision, no access, no
    network) with where it looked."""
    p = os.fspath(ref)
    if os.path.exists(p):
        return p
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(p)
    except HFValidationError:
        raise FileNotFoundError(
            f"{what} {p!r} does not exist: no such local path, and not a Hugging Face hub id "
            "(name or namespace/name)"
        ) from None
    offline, cache = hub_offline(), hub_cache_dir(download_dir)
    try:
        return snapshot_download(
            p,
            revision=revision,
            cache_dir=cache,
            token=token,
            local_files_only=offline,
            allow_patterns=list(TOKENIZER_FILES if what == "tokenizer" else MODEL_FILES),
        )
    except Exception as e:  # the hub's errors: HTTP, cache miss offline, network, bad revision
        where = f"revision {revision!r} of " if revision else ""
        mode = "HF_HUB_OFFLINE=1, unset it to download; looked in " if offline else ""
        raise FileNotFoundError(
            f"{what} {p!r} is no local path, and {where}Hugging Face hub id {p!r} could not be "
            f"resolved ({mode}{cache or 'the default HF cache'}): {type(e).__name__}: "
            + " ".join(str(e).split())
        ) from None


def resolve_model(
    model: str | os.PathLike,
    tokenizer: str | os.PathLike | None = None,
    *,
    revision: str | None = None,
    tokenizer_revision: str | None = None,
    download_dir: str | os.PathLike | None = None,
    hf_token: str | bool | None = None,
) -> tuple[str, str | None]:
    """vLLM's `LLM` arguments -> ``(model path, tokenizer path or None)`` by `resolve_path`
    (``revision`` for the model, ``tokenizer_revision`` for the tokenizer; the tokenizer first).
    FileNotFoundError: as `resolve_path`."""
    tok = tokenizer and resolve_path(
        tokenizer,
        what="tokenizer",
        revision=tokenizer_revision,
        download_dir=download_dir,
        token=hf_token,
    )
    return resolve_path(model, revision=revision, download_dir=download_dir, token=hf_token), tok
