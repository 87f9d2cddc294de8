"""One entry point for every checkpoint format: `open_checkpoint(path) -> Checkpoint`. Formats
(`detect_format`): "gguf", a ``*.gguf`` file (`gguf_loader`); "orbax", a dir with
``jaxinfer_config.json`` (`orbax_io`); "hf", a dir with ``config.json`` and safetensors."""

import json
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from checkpoints_tools import gguf_cache, gguf_loader, orbax_io

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
TOKENIZER_FILES = ("tokenizer_config.json", "tokenizer.json", "tokenizer.model", "vocab.json")


def detect_format(path: str | os.PathLike) -> str:
    """ "gguf" | "orbax" | "hf" of ``path``; FileNotFoundError: no ``path``; ValueError: other."""
    p = os.fspath(path)
    expected = (
        "expected a .gguf file, a directory with jaxinfer_config.json (an Orbax checkpoint "
        "from `python scripts/convert_checkpoint.py`), or an HF model directory with config.json "
        "and *.safetensors"
    )
    if not os.path.exists(p):
        raise FileNotFoundError(f"model path {p!r} does not exist")
    if os.path.isfile(p):
        if p.lower().endswith(".gguf"):
            return "gguf"
        raise ValueError(f"model path {p!r} is a file but not a GGUF file (.gguf); {expected}")
    if os.path.isfile(os.path.join(p, orbax_io.CONFIG_FILE)):
        return "orbax"
    if os.path.isfile(os.path.join(p, "config.json")):
        return "hf"
    raise ValueError(
        f"model directory {p!r} has neither jaxinfer_config.json nor config.json; {expected}"
    )


def _ids(value: Any) -> tuple[int, ...]:
    return tuple(
        int(v) for v in (value if isinstance(value, (list, tuple)) else [value]) if v is not None
    )


def read_json(path: str) -> dict:
    """A JSON object file. FileNotFoundError: absent; ValueError: not a JSON object."""
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"no {os.path.basename(path)} in model directory {os.path.dirname(path)!r}"
        )
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
    """An opened checkpoint (`detect_format`'s ``format``). config: HF ``config.json`` layout for
    "hf"/"gguf" (`gguf_loader.gguf_hf_config`), ``ModelConfig.to_dict()``'s for "orbax".
    generation_eos_ids: HF ``generation_config.json`` ``eos_token_id`` (() if absent), GGUF
    EOS/EOT/EOM ids, or the stored Orbax ones. reader: a GGUF file's ``GGUFReader``, else None."""

    path: str
    format: str
    config: dict
    generation_eos_ids: tuple[int, ...]
    reader: Any = None


def open_checkpoint(path: str | os.PathLike) -> Checkpoint:
    """The `Checkpoint` of ``path`` (config, EOS ids; no tensors; a GGUF file converted before:
    its "hf" `gguf_cache` entry). FileNotFoundError: a needed file
    (named); ValueError: unsupported format, unreadable file, bad JSON or GGUF metadata."""
    p = os.fspath(path)
    fmt = detect_format(p)
    if fmt == "gguf" and (cached := gguf_cache.lookup(p)) is not None:
        return open_checkpoint(cached)  # `gguf_cache`: an HF directory converted before
    if fmt == "gguf":
        reader = gguf_loader.open_gguf(p)
        return Checkpoint(
            p,
            fmt,
            gguf_loader.gguf_hf_config(reader),
            gguf_loader.gguf_eos_token_ids(reader),
            reader,
        )
    if fmt == "orbax":
        meta = orbax_io.read_saved_config(p)
        return Checkpoint(p, fmt, meta["model_config"], _ids(meta.get("eos_token_ids")))
    gen = os.path.join(p, "generation_config.json")
    eos = _ids(read_json(gen).get("eos_token_id")) if os.path.isfile(gen) else ()
    return Checkpoint(p, fmt, read_json(os.path.join(p, "config.json")), eos)


def hf_tensors(ckpt: Checkpoint, out_dtype=None) -> Iterable[tuple[str, Any]]:
    """``(HF name, numpy array [out, in])`` of an "hf"/"gguf" checkpoint; ``out_dtype``: GGUF cast.
    ValueError: an Orbax checkpoint, or `iter_tensors` / `gguf_loader.gguf_hf_tensors` errors."""
    if ckpt.format == "gguf":
        return gguf_loader.gguf_hf_tensors(ckpt.reader, ckpt.config, out_dtype or "float32")
    if ckpt.format == "hf":
        return iter_tensors(ckpt.path)
    raise ValueError(f"{ckpt.path!r} is an Orbax checkpoint: it holds a param tree, not HF tensors")


def load_tokenizer(path: "str | os.PathLike | Checkpoint", fmt: str | None = None):
    """Offline HF tokenizer of an HF dir, GGUF file or Orbax ``tokenizer/`` (``path`` or an opened
    `Checkpoint`: a GGUF's from its reader, `gguf_loader.gguf_tokenizer`); ``fmt`` if known.
    FileNotFoundError: no ``path``; ValueError: unsupported format, or no tokenizer."""
    import transformers

    if isinstance(path, Checkpoint):
        if path.reader is not None and (tok := gguf_loader.gguf_tokenizer(path.reader)):
            return tok
        path, fmt = path.path, path.format
    p = os.fspath(path)
    fmt = fmt or detect_format(p)
    d, name = os.path.split(os.path.abspath(p))
    args, kw = (
        ((d,), {"gguf_file": name})
        if fmt == "gguf"
        else ((os.path.join(p, orbax_io.TOKENIZER_DIR) if fmt == "orbax" else p,), {})
    )
    load, saved = (
        transformers.PreTrainedTokenizerFast.from_pretrained,
        f"{args[0]}/{TOKENIZER_FILES[0]}",
    )
    if fmt != "gguf":  # the saved class by name: AutoTokenizer's imports take seconds (torch's)
        if not any(os.path.isfile(os.path.join(args[0], f)) for f in TOKENIZER_FILES):
            raise ValueError(
                f"{fmt} model {p!r} has no tokenizer (none of {', '.join(TOKENIZER_FILES)}"
                f" in {args[0]!r}): give tokenizer=DIR, or skip_tokenizer_init"
            )
        name = (read_json(saved) if os.path.isfile(saved) else {}).get("tokenizer_class") or "-"
        cls = getattr(transformers, name + "Fast", None) or getattr(transformers, name, None)
        load = getattr(cls, "from_pretrained", None) or transformers.AutoTokenizer.from_pretrained
    try:
        return load(*args, local_files_only=True, **kw)
    except ImportError as e:  # transformers' GGUF reader imports torch
        raise ValueError(
            f"cannot load the tokenizer of {fmt} model {p!r}: {e}; GGUF tokenizers need"
            " PyTorch: pip install 'jaxinfer[gguf]' (or convert the model once with "
            "python scripts/convert_checkpoint.py where it is installed)"
        ) from e
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(
            f"cannot load a tokenizer for {fmt} model {p!r} from {args[0]!r}: "
            f"{type(e).__name__}: {e}"
        ) from e


def shard_files(path: str | os.PathLike) -> tuple[list[str], dict | None]:
    """Sorted safetensors files of an HF dir and the index's ``weight_map`` (None: single file).
    FileNotFoundError: no weights file or an absent shard (named); ValueError: no ``weight_map``."""
    root = os.fspath(path)
    index, single = (os.path.join(root, name) for name in (INDEX_FILE, SINGLE_FILE))
    if os.path.isfile(index):
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index!r} has no 'weight_map' object")
        files = [os.path.join(root, name) for name in sorted(set(weight_map.values()))]
    elif os.path.isfile(single):
        files, weight_map = [single], None
    else:
        raise FileNotFoundError(f"no {SINGLE_FILE!r} or {INDEX_FILE!r} in model directory {root!r}")
    for p in files:
        if not os.path.isfile(p):
            raise FileNotFoundError(
                f"safetensors shard {p!r} (named in {INDEX_FILE}) does not exist"
            )
    return files, weight_map


_RAW_DTYPES = {"BF16": "bfloat16", "F8_E4M3": "float8_e4m3fn"}  # numpy lacks them: `_read_raw`


def _read_raw(file: str, name: str):
    """Tensor ``name`` (a `_RAW_DTYPES` dtype) from its safetensors header offsets, read-only."""
    import struct

    import ml_dtypes
    import numpy as np

    with open(file, "rb") as f:
        size = struct.unpack("<Q", f.read(8))[0]
        info = json.loads(f.read(size))[name]
        start, stop = info["data_offsets"]
        f.seek(8 + size + start)
        data = f.read(stop - start)
    dtype = getattr(ml_dtypes, _RAW_DTYPES[info["dtype"]])
    return np.frombuffer(data, dtype).reshape(info["shape"])


def iter_tensors(path: str | os.PathLike) -> Iterator[tuple[str, Any]]:
    """``(name, numpy array)`` per tensor of an HF dir, one shard open at a time. ValueError: a
    tensor in two shards (named) or missing from its ``weight_map`` shard; `shard_files`' errors."""
    from safetensors import safe_open

    files, weight_map = shard_files(path)
    where: dict[str, str] = {}
    for file in files:
        with safe_open(file, framework="numpy") as f:
            for name in f.keys():
                if name in where:
                    raise ValueError(
                        f"duplicate tensor {name!r}: in shard {where[name]!r} and in "
                        f"shard {os.path.basename(file)!r}"
                    )
                where[name] = os.path.basename(file)
                try:
                    array = f.get_tensor(name)
                except (TypeError, ValueError, KeyError, AttributeError):
                    if f.get_slice(name).get_dtype() not in _RAW_DTYPES:
                        raise
                    array = _read_raw(file, name)
                yield name, array
    if weight_map is not None:
        for name, shard in weight_map.items():
            if where.get(name) != shard:
                raise ValueError(
                    f"{INDEX_FILE} maps tensor {name!r} to shard {shard!r}, but it is "
                    f"{'in ' + repr(where[name]) if name in where else 'in no shard'}"
                )
