"""Orbax checkpoint directory of a converted model: ``params/`` (StandardCheckpointer),
``tokenizer/`` (``save_pretrained``), ``jaxinfer_config.json`` ({"format", "version",
"model_config", "eos_token_ids", "dtype"}; written last, atomically: present means complete)."""

import json
import os
from typing import Any, Mapping, Sequence

import numpy as np

from checkpoints_tools.mapping import tree_mismatches

CONFIG_FILE = "jaxinfer_config.json"
PARAMS_DIR = "params"
TOKENIZER_DIR = "tokenizer"
FORMAT_NAME = "jaxinfer-orbax"
FORMAT_VERSION = 1


def read_saved_config(src_dir: str | os.PathLike) -> dict:
    """The parsed ``jaxinfer_config.json`` of ``src_dir``. FileNotFoundError: absent; ValueError:
    not a jaxinfer checkpoint config, or an unsupported format version."""
    p = os.path.join(os.fspath(src_dir), CONFIG_FILE)
    if not os.path.isfile(p):
        raise FileNotFoundError(f"no {CONFIG_FILE} in checkpoint directory {os.fspath(src_dir)!r}")
    with open(p) as f:
        meta = json.load(f)
    if meta.get("format") != FORMAT_NAME or meta.get("version") != FORMAT_VERSION:
        raise ValueError(f"{p}: format={meta.get('format')!r} version={meta.get('version')!r}; "
                         f"expected format={FORMAT_NAME!r} version={FORMAT_VERSION}")
    return meta


def save(dst_dir: str | os.PathLike, config: Mapping[str, Any], params, abstract, tokenizer,
         eos_ids: Sequence[int]) -> None:
    """Write a JSON-able ``config``, ``params`` (one dtype, fitting ``abstract``), an HF
    ``tokenizer`` (or None) and the generation ``eos_ids`` to a new or empty ``dst_dir``.
    FileExistsError: ``dst_dir`` not empty; ValueError: params misfit ``abstract``, mixed dtypes."""
    import jax
    import orbax.checkpoint as ocp

    dst = os.path.abspath(os.fspath(dst_dir))
    if os.path.exists(dst) and (not os.path.isdir(dst) or os.listdir(dst)):
        raise FileExistsError(f"destination {dst!r} exists and is not an empty directory")
    bad = tree_mismatches(abstract, params)
    if bad:
        raise ValueError(f"params do not match the config: {'; '.join(bad)}")
    dtypes = {np.dtype(x.dtype).name for x in jax.tree_util.tree_leaves(params)}
    if len(dtypes) != 1:
        raise ValueError(f"params mix dtypes {sorted(dtypes)}; expected one dtype")
    os.makedirs(dst, exist_ok=True)
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(os.path.join(dst, PARAMS_DIR), params)
        ckptr.wait_until_finished()
    if tokenizer is not None:
        tokenizer.save_pretrained(os.path.join(dst, TOKENIZER_DIR))
    meta = {"format": FORMAT_NAME, "version": FORMAT_VERSION, "model_config": dict(config),
            "eos_token_ids": [int(t) for t in eos_ids], "dtype": dtypes.pop()}
    tmp = os.path.join(dst, CONFIG_FILE + ".tmp")
    with open(tmp, "w") as f:
        json.dump(meta, f, indent=2)
    os.replace(tmp, os.path.join(dst, CONFIG_FILE))


def restore(src_dir: str | os.PathLike, abstract, on_host: bool = False):
    """`save`'s params as jax arrays on ``jax.devices()[0]`` (``on_host``: numpy) in ``abstract``'s
    shapes and dtypes. FileNotFoundError: no ``params/``; ValueError: misfit (paths named)."""
    import jax
    import orbax.checkpoint as ocp

    src = os.path.abspath(os.fspath(src_dir))
    params_dir = os.path.join(src, PARAMS_DIR)
    if not os.path.isdir(params_dir):
        raise FileNotFoundError(f"checkpoint {src!r} has no {PARAMS_DIR}/ directory")
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target = jax.tree_util.tree_map(  # a numpy leaf's target: its dtype (orbax reads the shape)
        lambda s: np.empty(0, s.dtype) if on_host else
        jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding), abstract)
    with ocp.StandardCheckpointer() as ckptr:
        misfit = f"checkpoint {src!r}: the stored params do not fit its {CONFIG_FILE}"
        try:  # stored shapes from orbax metadata, checked before any data is read
            md = ckptr.metadata(params_dir)
            md = getattr(md, "item_metadata", md)
            stored = dict(getattr(md, "tree", md))
        except (AttributeError, TypeError, ValueError):  # another metadata layout: restore checks
            stored = None
        bad = tree_mismatches(abstract, stored) if stored is not None else []
        if bad:
            raise ValueError(f"{misfit} (shape mismatch: {'; '.join(bad)})")
        try:
            return ckptr.restore(params_dir, target)
        except ValueError as e:
            raise ValueError(f"{misfit}: {e}") from e
