"""Save / restore a converted model as an Orbax checkpoint directory, so a second start skips the
HF-safetensors or GGUF conversion.

Directory layout (written by `save`, read by `restore` and `checkpoints_tools.loader`):

    DST/params/               the param tree (`jaxinfer.models.params` layout), orbax StandardCheckpointer
    DST/tokenizer/            ``tokenizer.save_pretrained`` output
    DST/jaxinfer_config.json  {"format", "version", "model_config": ModelConfig.to_dict(),
                               "eos_token_ids": [...], "dtype": "bfloat16"|"float32"}

``jaxinfer_config.json`` is written last (atomically), so a directory holding it is a complete
checkpoint; an interrupted save never looks like one.
"""

from __future__ import annotations

import json
import os
from typing import Any, Sequence

CONFIG_FILE = "jaxinfer_config.json"
PARAMS_DIR = "params"
TOKENIZER_DIR = "tokenizer"
FORMAT_NAME = "jaxinfer-orbax"
FORMAT_VERSION = 1


def is_orbax_dir(path: str | os.PathLike) -> bool:
    """True when ``path`` is a directory holding ``jaxinfer_config.json``."""
    return os.path.isfile(os.path.join(os.fspath(path), CONFIG_FILE))


def read_saved_config(src_dir: str | os.PathLike) -> dict:
    """The parsed ``jaxinfer_config.json`` of a checkpoint directory.

    Raises:
        FileNotFoundError: no ``jaxinfer_config.json`` in ``src_dir``.
        ValueError: not a jaxinfer checkpoint config, or an unsupported format version.
    """
    p = os.path.join(os.fspath(src_dir), CONFIG_FILE)
    if not os.path.isfile(p):
        raise FileNotFoundError(f"no {CONFIG_FILE} in checkpoint directory {os.fspath(src_dir)!r}")
    with open(p) as f:
        meta = json.load(f)
    if meta.get("format") != FORMAT_NAME or meta.get("version") != FORMAT_VERSION:
        raise ValueError(f"{p}: format={meta.get('format')!r} version={meta.get('version')!r}; "
                         f"expected format={FORMAT_NAME!r} version={FORMAT_VERSION}")
    return meta


def _dtype_name(params) -> str:
    import jax
    import numpy as np

    names = {np.dtype(x.dtype).name for x in jax.tree_util.tree_leaves(params)}
    if len(names) != 1:
        raise ValueError(f"params mix dtypes {sorted(names)}; expected one dtype")
    return names.pop()


def save(dst_dir: str | os.PathLike, cfg, params, tokenizer, eos_ids: Sequence[int]) -> None:
    """Write ``cfg``, ``params``, ``tokenizer`` and ``eos_ids`` to a new checkpoint directory.

    Args:
        dst_dir: the directory to create (it may exist if it is empty).
        cfg: the `jaxinfer.config.ModelConfig`.
        params: the param tree (jax or numpy arrays, one dtype), shapes of ``param_shapes(cfg)``.
        tokenizer: an HF tokenizer (``save_pretrained``), or None to store none.
        eos_ids: the generation EOS ids to keep next to the model (e.g. from
            ``generation_config.json`` or GGUF metadata).
    Raises:
        FileExistsError: ``dst_dir`` exists and is not an empty directory.
        ValueError: params whose structure or shapes do not match ``cfg``.
    """
    import jax
    import orbax.checkpoint as ocp

    from jaxinfer.models.params import param_shapes

    dst = os.path.abspath(os.fspath(dst_dir))
    if os.path.exists(dst) and (not os.path.isdir(dst) or os.listdir(dst)):
        raise FileExistsError(f"destination {dst!r} exists and is not an empty directory")
    bad = _shape_mismatches(param_shapes(cfg),
                            jax.tree_util.tree_map(lambda x: tuple(x.shape), params))
    if bad:
        raise ValueError(f"params do not match the config: {'; '.join(bad)}")
    dtype = _dtype_name(params)
    os.makedirs(dst, exist_ok=True)

    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(os.path.join(dst, PARAMS_DIR), params)
        ckptr.wait_until_finished()
    if tokenizer is not None:
        tokenizer.save_pretrained(os.path.join(dst, TOKENIZER_DIR))

    meta: dict[str, Any] = {
        "format": FORMAT_NAME,
        "version": FORMAT_VERSION,
        "model_config": cfg.to_dict(),
        "eos_token_ids": [int(t) for t in eos_ids],
        "dtype": dtype,
    }
    tmp = os.path.join(dst, CONFIG_FILE + ".tmp")
    with open(tmp, "w") as f:
        json.dump(meta, f, indent=2)
    os.replace(tmp, os.path.join(dst, CONFIG_FILE))


def _stored_shapes(ckptr, params_dir: str) -> dict | None:
    """Nested dict of the stored arrays' shapes from orbax metadata; None if this orbax version
    lays its metadata out differently (then the restore's own check is the only one)."""
    import jax

    try:
        md = ckptr.metadata(params_dir)
        tree = getattr(md, "item_metadata", md)
        tree = getattr(tree, "tree", tree)
        return jax.tree_util.tree_map(lambda m: tuple(int(d) for d in m.shape), dict(tree))
    except (AttributeError, TypeError, ValueError):
        return None


def _shape_mismatches(want: dict, got: dict) -> list[str]:
    """``"<path>: has <shape>, expected <shape>"`` for every param path (e.g.
    ``['layers']['3']['wqkv']``) whose shape in ``got`` differs from ``want`` (None: absent)."""
    import jax

    def flat(tree):
        leaves, _ = jax.tree_util.tree_flatten_with_path(tree,
                                                         is_leaf=lambda x: isinstance(x, tuple))
        return {jax.tree_util.keystr(k): v for k, v in leaves}

    want, got = flat(want), flat(got)
    return [f"{k}: has {got.get(k)}, expected {want.get(k)}"
            for k in sorted(set(want) | set(got)) if want.get(k) != got.get(k)]


def _check_stored_shapes(ckptr, params_dir: str, cfg, src: str) -> None:
    """Compare the stored shapes with ``param_shapes(cfg)`` before reading any data.

    Raises:
        ValueError: names every param path whose stored shape differs, is missing or is extra.
    """
    from jaxinfer.models.params import param_shapes

    stored = _stored_shapes(ckptr, params_dir)
    if stored is None:
        return
    bad = _shape_mismatches(param_shapes(cfg), stored)
    if bad:
        raise ValueError(f"checkpoint {src!r}: the stored params do not fit its {CONFIG_FILE} "
                         f"(shape mismatch: {'; '.join(bad)})")


def restore(src_dir: str | os.PathLike, dtype="bfloat16"):
    """Read a checkpoint written by `save` into ``(ModelConfig, params)``.

    Params are restored into ``abstract_params(cfg, dtype)`` placed on the default device, so a
    shape or tree-structure mismatch with the saved config is an error and the stored dtype is cast
    to ``dtype``.

    Args:
        src_dir: the checkpoint directory.
        dtype: dtype of the returned arrays ("bfloat16", "float32" or a jnp dtype).
    Returns:
        (cfg, params) with params as jax arrays on ``jax.devices()[0]``.
    Raises:
        FileNotFoundError: no ``jaxinfer_config.json`` or no ``params/`` in ``src_dir``.
        ValueError: bad format version, or saved arrays that do not fit the config.
    """
    import jax
    import orbax.checkpoint as ocp

    from jaxinfer.config import ModelConfig
    from jaxinfer.models.params import abstract_params

    src = os.path.abspath(os.fspath(src_dir))
    meta = read_saved_config(src)
    cfg = ModelConfig.from_dict(meta["model_config"])
    params_dir = os.path.join(src, PARAMS_DIR)
    if not os.path.isdir(params_dir):
        raise FileNotFoundError(f"checkpoint {src!r} has no {PARAMS_DIR}/ directory")
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target = jax.tree_util.tree_map(
        lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding),
        abstract_params(cfg, dtype))
    with ocp.StandardCheckpointer() as ckptr:
        _check_stored_shapes(ckptr, params_dir, cfg, src)
        try:
            params = ckptr.restore(params_dir, target)
        except ValueError as e:
            raise ValueError(f"checkpoint {src!r}: the stored params do not fit its "
                             f"{CONFIG_FILE} ({cfg}): {e}") from e
    return cfg, params
