"""An Orbax checkpoint directory, written by ``scripts/convert_checkpoint.py``: ``params/``
(StandardCheckpointer), ``tokenizer/`` (``save_pretrained``), ``jaxinfer_config.json`` ({"format",
"version", "model_config", "eos_token_ids", "dtype"}; last, atomically: present means complete)."""

import json
import os

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
        raise ValueError(
            f"{p}: format={meta.get('format')!r} version={meta.get('version')!r}; "
            f"expected format={FORMAT_NAME!r} version={FORMAT_VERSION}"
        )
    return meta


def restore(src_dir: str | os.PathLike, abstract, on_host: bool = False):
    """The stored params, jax arrays on ``jax.devices()[0]`` (``on_host``: numpy), in ``abstract``'s
    shapes and dtypes. FileNotFoundError: no ``params/``; ValueError: misfit (paths named)."""
    import jax
    import orbax.checkpoint as ocp

    src = os.path.abspath(os.fspath(src_dir))
    params_dir = os.path.join(src, PARAMS_DIR)
    if not os.path.isdir(params_dir):
        raise FileNotFoundError(f"checkpoint {src!r} has no {PARAMS_DIR}/ directory")
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target = jax.tree_util.tree_map(  # a numpy leaf's target: its dtype (orbax reads the shape)
        lambda s: (
            np.empty(0, s.dtype)
            if on_host
            else jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding)
        ),
        abstract,
    )
    with ocp.StandardCheckpointer() as ckptr:
        misfit = f"checkpoint {src!r}: the stored params do not fit its {CONFIG_FILE}"
        try:  # stored shapes from orbax metadata, checked before any data is read
            md = ckptr.metadata(params_dir)
            md = getattr(md, "item_metadata", md)
            stored = dict(getattr(md, "tree", md))
        except (AttributeError, TypeError, ValueError):  # another metadata layout: restore checks
            stored = None
        if stored is not None and (bad := tree_mismatches(abstract, stored)):
            raise ValueError(f"{misfit} (shape mismatch: {'; '.join(bad)})")
        try:
            return ckptr.restore(params_dir, target)
        except ValueError as e:
            raise ValueError(f"{misfit}: {e}") from e
