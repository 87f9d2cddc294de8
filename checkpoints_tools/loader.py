"""One entry point for every checkpoint format: `load_model(path, dtype) -> LoadedModel`.

Formats, told apart by `detect_format`:
    "gguf"   a ``*.gguf`` file (llama.cpp; Llama / Qwen3)              -> `gguf_loader.load_gguf`
    "orbax"  a directory with ``jaxinfer_config.json`` (from convert)  -> `orbax_io.restore`
    "hf"     a directory with ``config.json`` (+ ``*.safetensors``)     -> `safetensors_loader`

The tokenizer comes from the same place (`load_tokenizer`), always offline (``local_files_only``).
EOS handling (CASES.md C4): the engine stops on the union of the tokenizer's EOS id, the
generation-config EOS ids (HF ``generation_config.json``, GGUF metadata, or the ids an Orbax
checkpoint stored) and ``ModelConfig.eos_token_ids``; `LoadedModel.eos_token_ids` is that union.

Heavy imports (JAX, transformers, orbax) happen inside the functions, so `detect_format` is cheap
and a CLI can validate its arguments before loading anything.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Iterable

from jaxinfer.config import ModelConfig

FORMATS = ("hf", "gguf", "orbax")


@dataclass(frozen=True, eq=False)
class LoadedModel:
    """A model ready for the engine.

    config: `jaxinfer.config.ModelConfig`.
    params: the param tree of `jaxinfer.models.params` (jax arrays of the requested dtype).
    tokenizer: an HF tokenizer (``PreTrainedTokenizerBase``).
    eos_token_ids: the union (first-seen order) of the tokenizer's ``eos_token_id``, the
        generation-config EOS ids and ``config.eos_token_ids``.
    source: "hf" | "gguf" | "orbax".
    """

    config: Any
    params: Any
    tokenizer: Any
    eos_token_ids: tuple[int, ...]
    source: str


def detect_format(path: str | os.PathLike) -> str:
    """"gguf" | "orbax" | "hf" for ``path`` (see the module docstring). No heavy imports.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: ``path`` is none of the supported formats (says what was expected).
    """
    from checkpoints_tools.orbax_io import CONFIG_FILE

    p = os.fspath(path)
    expected = ("expected a .gguf file, a directory with jaxinfer_config.json (an Orbax checkpoint "
                "from `python -m checkpoints_tools.convert`), or an HF model directory with "
                "config.json and *.safetensors")
    if not os.path.exists(p):
        raise FileNotFoundError(f"model path {p!r} does not exist")
    if os.path.isfile(p):
        if p.lower().endswith(".gguf"):
            return "gguf"
        raise ValueError(f"model path {p!r} is a file but not a .gguf file; {expected}")
    if os.path.isfile(os.path.join(p, CONFIG_FILE)):
        return "orbax"
    if os.path.isfile(os.path.join(p, "config.json")):
        return "hf"
    raise ValueError(f"model directory {p!r} has neither jaxinfer_config.json nor config.json; "
                     f"{expected}")


def _ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, (list, tuple)):
        return tuple(int(v) for v in value)
    return (int(value),)


def generation_eos_ids(path: str | os.PathLike) -> tuple[int, ...]:
    """The generation-config EOS ids of a model: HF ``generation_config.json`` ``eos_token_id``
    (int or list; () when the file or key is absent), the GGUF metadata EOS/EOT/EOM ids, or the ids
    stored in an Orbax checkpoint.

    Raises:
        FileNotFoundError, ValueError: as `detect_format`.
    """
    p = os.fspath(path)
    fmt = detect_format(p)
    if fmt == "gguf":
        from checkpoints_tools.gguf_loader import gguf_eos_token_ids, open_gguf

        return gguf_eos_token_ids(open_gguf(p))
    if fmt == "orbax":
        from checkpoints_tools.orbax_io import read_saved_config

        return _ids(read_saved_config(p).get("eos_token_ids"))
    gen = os.path.join(p, "generation_config.json")
    if not os.path.isfile(gen):
        return ()
    with open(gen) as f:
        return _ids(json.load(f).get("eos_token_id"))


def load_tokenizer(path: str | os.PathLike):
    """The HF tokenizer of a model and its generation-config EOS ids, offline.

    HF dir: ``AutoTokenizer.from_pretrained(dir)``; GGUF file: ``AutoTokenizer.from_pretrained(
    dirname, gguf_file=basename)`` (HF builds a fast tokenizer from the GGUF vocabulary); Orbax dir:
    the tokenizer saved under ``tokenizer/``. Always ``local_files_only=True``.

    Returns:
        (tokenizer, generation_eos_ids: tuple[int, ...]) — see `generation_eos_ids`.
    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: not a supported format, or no tokenizer could be loaded from it.
    """
    from transformers import AutoTokenizer

    p = os.fspath(path)
    fmt = detect_format(p)
    if fmt == "gguf":
        d, name = os.path.split(os.path.abspath(p))
        args, kw = (d,), {"gguf_file": name}
    elif fmt == "orbax":
        from checkpoints_tools.orbax_io import TOKENIZER_DIR

        args, kw = (os.path.join(p, TOKENIZER_DIR),), {}
    else:
        args, kw = (p,), {}
    try:
        tok = AutoTokenizer.from_pretrained(*args, local_files_only=True, **kw)
    except ImportError as e:  # transformers' GGUF reader imports torch
        raise ValueError(f"cannot load the tokenizer of {fmt} model {p!r}: {e}; transformers needs "
                         "PyTorch for GGUF tokenizers: pip install 'jaxinfer[gguf]' (or convert the "
                         "model once with python -m checkpoints_tools.convert on a machine that has it)"
                         ) from e
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"cannot load a tokenizer for {fmt} model {p!r} from {args[0]!r}: "
                         f"{type(e).__name__}: {e}") from e
    return tok, generation_eos_ids(p)


def union_ids(*groups: Iterable[int | None]) -> tuple[int, ...]:
    """Ordered union of id groups (first occurrence wins; None entries skipped)."""
    out: list[int] = []
    for g in groups:
        for t in g:
            if t is not None and int(t) not in out:
                out.append(int(t))
    return tuple(out)


def load_params(path: str | os.PathLike, dtype="bfloat16", fmt: str | None = None):
    """``(ModelConfig, params)`` of the model at ``path`` in ``dtype``, without the tokenizer.

    Raises:
        FileNotFoundError, ValueError: as `detect_format` and the format's loader.
    """
    fmt = fmt or detect_format(path)
    if fmt == "gguf":
        from checkpoints_tools.gguf_loader import load_gguf

        return load_gguf(path, dtype)
    if fmt == "orbax":
        from checkpoints_tools.orbax_io import restore

        return restore(path, dtype)
    from checkpoints_tools.safetensors_loader import load_safetensors_dir

    return load_safetensors_dir(path, dtype)


def load_model(path: str | os.PathLike, dtype="bfloat16", *,
               with_tokenizer: bool = True) -> LoadedModel:
    """Load config, params and tokenizer from an HF directory, a GGUF file or an Orbax checkpoint.

    Args:
        path: see `detect_format`.
        dtype: parameter dtype ("bfloat16", "float32" or a jnp dtype).
        with_tokenizer: False skips the tokenizer (``tokenizer`` is None; token-id prompts only);
            EOS ids then come from the generation config and the model config.
    Returns:
        `LoadedModel`.
    Raises:
        FileNotFoundError: ``path`` does not exist (named in the message).
        ValueError: an unsupported format or architecture, bad tensors, or no tokenizer.
    """
    p = os.fspath(path)
    fmt = detect_format(p)
    if fmt == "hf":  # an unsupported architecture fails here, before any tokenizer is built
        ModelConfig.from_hf_dir(p)
    if with_tokenizer:
        tokenizer, gen_eos = load_tokenizer(p)
        tok_eos = (tokenizer.eos_token_id,)
    else:
        tokenizer, gen_eos, tok_eos = None, generation_eos_ids(p), ()
    cfg, params = load_params(p, dtype, fmt)
    eos = union_ids(tok_eos, gen_eos, cfg.eos_token_ids)
    return LoadedModel(config=cfg, params=params, tokenizer=tokenizer, eos_token_ids=eos,
                       source=fmt)
