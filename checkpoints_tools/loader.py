"""One entry point for every checkpoint format: `open_checkpoint(path) -> Checkpoint`.

Formats, told apart by `detect_format`:
    "gguf"   a ``*.gguf`` file (llama.cpp; Llama / Qwen3)                  -> `gguf_loader`
    "orbax"  a directory with ``jaxinfer_config.json`` (``jaxinfer.convert``) -> `orbax_io`
    "hf"     a directory with ``config.json`` (+ ``*.safetensors``)         -> `safetensors_loader`

A `Checkpoint` holds the model config as a plain dict and the generation-config EOS ids, and keeps
a GGUF file open, so its metadata is parsed once per load. `hf_tensors` yields HF-named tensors
for `checkpoints_tools.mapping`; the tokenizer comes from the same place (`load_tokenizer`),
always offline (``local_files_only``). Heavy imports (JAX, transformers, orbax, gguf) happen inside
the functions, so `detect_format` is cheap and a CLI can validate its arguments before loading.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Iterable

FORMATS = ("hf", "gguf", "orbax")


def detect_format(path: str | os.PathLike) -> str:
    """"gguf" | "orbax" | "hf" for ``path`` (see the module docstring). No heavy imports.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: ``path`` is none of the supported formats (says what was expected).
    """
    from checkpoints_tools.orbax_io import CONFIG_FILE

    p = os.fspath(path)
    expected = ("expected a .gguf file, a directory with jaxinfer_config.json (an Orbax checkpoint "
                "from `python -m jaxinfer.convert`), or an HF model directory with config.json "
                "and *.safetensors")
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


def read_json(path: str) -> dict:
    """A JSON object file. Raises FileNotFoundError (absent), ValueError (not a JSON object)."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no {os.path.basename(path)} in model directory "
                                f"{os.path.dirname(path)!r}")
    with open(path) as f:
        try:
            out = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not valid JSON ({e.msg} at line {e.lineno})") from None
    if not isinstance(out, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return out


@dataclass(frozen=True, eq=False)
class Checkpoint:
    """An opened checkpoint.

    path: the file or directory. format: "hf" | "gguf" | "orbax".
    config: the model config dict: HF ``config.json`` layout for "hf" and "gguf" (built from the
        metadata, `gguf_loader.gguf_hf_config`), ``ModelConfig.to_dict()`` layout for "orbax".
    generation_eos_ids: HF ``generation_config.json`` ``eos_token_id`` (int or list; () when the
        file or key is absent), the GGUF metadata EOS/EOT/EOM ids, or the ids an Orbax checkpoint
        stored.
    reader: the open ``gguf.GGUFReader`` of a GGUF file (memory-mapped), else None.
    """

    path: str
    format: str
    config: dict
    generation_eos_ids: tuple[int, ...]
    reader: Any = None


def open_checkpoint(path: str | os.PathLike) -> Checkpoint:
    """Detect the format of ``path`` and read its config and generation EOS ids (no tensor data).

    Raises:
        FileNotFoundError: ``path`` or a file the format needs does not exist (named).
        ValueError: an unsupported format, unreadable file, bad JSON, or unsupported GGUF metadata.
    """
    p = os.fspath(path)
    fmt = detect_format(p)
    if fmt == "gguf":
        from checkpoints_tools.gguf_loader import gguf_eos_token_ids, gguf_hf_config, open_gguf

        reader = open_gguf(p)
        return Checkpoint(p, fmt, gguf_hf_config(reader), gguf_eos_token_ids(reader), reader)
    if fmt == "orbax":
        from checkpoints_tools.orbax_io import read_saved_config

        meta = read_saved_config(p)
        return Checkpoint(p, fmt, meta["model_config"], _ids(meta.get("eos_token_ids")))
    gen = os.path.join(p, "generation_config.json")
    eos = _ids(read_json(gen).get("eos_token_id")) if os.path.isfile(gen) else ()
    return Checkpoint(p, fmt, read_json(os.path.join(p, "config.json")), eos)


def hf_tensors(ckpt: Checkpoint, out_dtype=None) -> Iterable[tuple[str, Any]]:
    """``(HF name, numpy array)`` pairs of an "hf" or "gguf" checkpoint, HF ``[out, in]`` layout.

    ``out_dtype`` (numpy dtype, GGUF only) casts each dequantised tensor as it is read, so a bf16
    load never holds the whole model in float32; HF tensors keep their stored dtype.

    Raises:
        ValueError: an "orbax" checkpoint (it holds a param tree, not HF tensors), or the format
            reader's errors (see `safetensors_loader.iter_tensors`, `gguf_loader.gguf_hf_tensors`).
    """
    if ckpt.format == "gguf":
        import numpy as np

        from checkpoints_tools.gguf_loader import gguf_hf_tensors

        return gguf_hf_tensors(ckpt.reader, ckpt.config, out_dtype or np.float32)
    if ckpt.format == "hf":
        from checkpoints_tools.safetensors_loader import iter_tensors

        return iter_tensors(ckpt.path)
    raise ValueError(f"{ckpt.path!r} is an Orbax checkpoint: it holds a param tree, not HF tensors")


def load_tokenizer(path: str | os.PathLike, fmt: str | None = None):
    """The HF tokenizer of a model, offline (``local_files_only=True``).

    HF dir: ``AutoTokenizer.from_pretrained(dir)``; GGUF file: ``AutoTokenizer.from_pretrained(
    dirname, gguf_file=basename)`` (HF builds a fast tokenizer from the GGUF vocabulary); Orbax dir:
    the tokenizer saved under ``tokenizer/``. ``fmt``: the format if already known.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: not a supported format, or no tokenizer could be loaded from it.
    """
    from transformers import AutoTokenizer

    p = os.fspath(path)
    fmt = fmt or detect_format(p)
    if fmt == "gguf":
        d, name = os.path.split(os.path.abspath(p))
        args, kw = (d,), {"gguf_file": name}
    elif fmt == "orbax":
        from checkpoints_tools.orbax_io import TOKENIZER_DIR

        args, kw = (os.path.join(p, TOKENIZER_DIR),), {}
    else:
        args, kw = (p,), {}
    try:
        return AutoTokenizer.from_pretrained(*args, local_files_only=True, **kw)
    except ImportError as e:  # transformers' GGUF reader imports torch
        raise ValueError(f"cannot load the tokenizer of {fmt} model {p!r}: {e}; transformers needs "
                         "PyTorch for GGUF tokenizers: pip install 'jaxinfer[gguf]' (or convert the "
                         "model once with python -m jaxinfer.convert on a machine that has it)"
                         ) from e
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"cannot load a tokenizer for {fmt} model {p!r} from {args[0]!r}: "
                         f"{type(e).__name__}: {e}") from e


def union_ids(*groups: Iterable[int | None]) -> tuple[int, ...]:
    """Ordered union of id groups (first occurrence wins; None entries skipped)."""
    out: list[int] = []
    for g in groups:
        for t in g:
            if t is not None and int(t) not in out:
                out.append(int(t))
    return tuple(out)
