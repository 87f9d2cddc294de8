"""Read the tensors of an HF model directory (``config.json`` + safetensors, single or sharded).

Layout read (the ``save_pretrained(..., safe_serialization=True)`` output):
    config.json
    model.safetensors                                   (single file), or
    model.safetensors.index.json + the shards its ``weight_map`` names

Names, shapes, tying and duplicates are checked by `checkpoints_tools.mapping`; this module adds
the file-level checks (a tensor in two shards, an index naming a tensor its shard
lacks, missing files).
"""

from __future__ import annotations

import json
import os
from typing import Iterator

import numpy as np
from safetensors import safe_open

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def shard_files(path: str | os.PathLike) -> tuple[list[str], dict | None]:
    """The safetensors files of a model directory, in a stable order, and the index's
    ``weight_map`` (tensor name -> shard file name; ``None`` for a single ``model.safetensors``).

    Raises:
        FileNotFoundError: no directory, no weights file, or a shard the index names is absent
            (the message has the path).
        ValueError: an index without a ``weight_map``.
    """
    root = os.fspath(path)
    if not os.path.isdir(root):
        raise FileNotFoundError(f"model directory {root!r} does not exist")
    index = os.path.join(root, INDEX_FILE)
    single = os.path.join(root, SINGLE_FILE)
    weight_map = None
    if os.path.isfile(index):
        with open(index) as f:
            weight_map = json.load(f).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index!r} has no 'weight_map' object")
        files = [os.path.join(root, name) for name in sorted(set(weight_map.values()))]
    elif os.path.isfile(single):
        files = [single]
    else:
        raise FileNotFoundError(f"no {SINGLE_FILE!r} or {INDEX_FILE!r} in model directory {root!r}")
    for p in files:
        if not os.path.isfile(p):
            raise FileNotFoundError(f"safetensors shard {p!r} (named in {INDEX_FILE}) does not exist")
    return files, weight_map


def _read_via_jax(file: str, name: str) -> np.ndarray:
    """Fallback for safetensors builds whose numpy reader rejects bf16: read through the flax
    framework on the CPU device and convert to numpy (ml_dtypes bfloat16)."""
    import jax

    with jax.default_device(jax.devices("cpu")[0]):
        with safe_open(file, framework="flax") as f:
            return np.asarray(f.get_tensor(name))


def read_tensor(f, file: str, name: str) -> np.ndarray:
    """One tensor of an open numpy ``safe_open`` handle as numpy (bf16 as ml_dtypes.bfloat16)."""
    try:
        return f.get_tensor(name)
    except (TypeError, ValueError, KeyError):
        if f.get_slice(name).get_dtype() != "BF16":
            raise
        return _read_via_jax(file, name)


def iter_tensors(path: str | os.PathLike) -> Iterator[tuple[str, np.ndarray]]:
    """Yield ``(name, array)`` for every tensor of every shard, one shard open at a time.

    Raises:
        ValueError: a tensor in two shards (both files named), or an index ``weight_map`` naming a
            tensor in a shard that lacks it.
        FileNotFoundError: see `shard_files`.
    """
    files, weight_map = shard_files(path)
    where: dict[str, str] = {}
    for file in files:
        with safe_open(file, framework="numpy") as f:
            for name in f.keys():
                if name in where:
                    raise ValueError(f"duplicate tensor {name!r}: in shard {where[name]!r} and in "
                                     f"shard {os.path.basename(file)!r}")
                where[name] = os.path.basename(file)
                yield name, read_tensor(f, file, name)
    if weight_map is not None:
        for name, shard in weight_map.items():
            if where.get(name) != shard:
                raise ValueError(f"{INDEX_FILE} maps tensor {name!r} to shard {shard!r}, but it is "
                                 f"{'in ' + repr(where[name]) if name in where else 'in no shard'}")
