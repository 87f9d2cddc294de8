"""A model from a checkpoint: `load_model(path, dtype) -> LoadedModel`.

`checkpoints_tools` reads the files (HF directory, GGUF file or Orbax directory: a config dict and
HF-named tensors) and maps tensor names; this module turns the config dict into a `ModelConfig` and
hands the mapping the abstract tree of `jaxinfer.models`, the only shape source.
EOS ids (CASES.md C4): `LoadedModel.eos_token_ids` is the union, in first-seen order, of the
tokenizer's EOS id, the generation-config EOS ids (HF ``generation_config.json``, GGUF metadata,
or those an Orbax checkpoint stored) and ``ModelConfig.eos_token_ids``.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from checkpoints_tools import orbax_io
from checkpoints_tools.loader import Checkpoint, hf_tensors, load_tokenizer, open_checkpoint
from checkpoints_tools.mapping import TensorSource, hf_tensors_to_params
from jaxinfer.config import ModelConfig
from jaxinfer.models import abstract_params, fused_parts


class LoadedModel(NamedTuple):
    """config (``tie_word_embeddings`` decided from the tensors); params (jax arrays of the
    requested dtype); tokenizer (HF, or None when not loaded); eos_token_ids (module docstring);
    source: "hf" | "gguf" | "orbax"."""

    config: ModelConfig
    params: Any
    tokenizer: Any
    eos_token_ids: tuple[int, ...]
    source: str


def model_config(ckpt: Checkpoint) -> ModelConfig:
    """The `ModelConfig` of an opened checkpoint. Raises ValueError: unsupported config."""
    if ckpt.format == "orbax":
        return ModelConfig.from_dict(ckpt.config)
    return ModelConfig.from_hf_config(ckpt.config)


def read_model_config(path: str | os.PathLike) -> ModelConfig:
    """The `ModelConfig` of the checkpoint at ``path`` (no tensor data read; to load it next,
    ``model_config(ckpt := open_checkpoint(path))`` then ``load_model(ckpt)`` parse a GGUF once).
    Raises FileNotFoundError: ``path`` or its config file is absent; ValueError: unsupported."""
    return model_config(open_checkpoint(path))


def params_from_hf(tensors: TensorSource, cfg: ModelConfig, dtype) -> tuple[dict, ModelConfig]:
    """``(params, cfg with tie_word_embeddings decided from the tensors)`` from HF-named tensors
    (`checkpoints_tools.mapping.hf_tensors_to_params`: its errors and warnings)."""
    untied = dataclasses.replace(cfg, tie_word_embeddings=False)
    params = hf_tensors_to_params(tensors, cfg, abstract_params(untied, dtype), fused_parts(cfg))
    return params, dataclasses.replace(cfg, tie_word_embeddings="lm_head" not in params)


def load_params(ckpt: Checkpoint | str | os.PathLike, dtype, cfg: ModelConfig | None = None
                ) -> tuple[ModelConfig, dict]:
    """``(config, params)`` of a checkpoint (opened, or a path) in ``dtype`` ("bfloat16",
    "float32" or a jnp dtype), without the tokenizer; ``cfg``: its `model_config` if already built.
    Raises FileNotFoundError, ValueError: the format reader's and the mapping's errors."""
    ckpt = ckpt if isinstance(ckpt, Checkpoint) else open_checkpoint(ckpt)
    cfg = cfg or model_config(ckpt)
    if ckpt.format == "orbax":
        return cfg, orbax_io.restore(ckpt.path, abstract_params(cfg, dtype))
    params, cfg = params_from_hf(hf_tensors(ckpt, np.dtype(jnp.dtype(dtype))), cfg, dtype)
    return cfg, params


def load_model(path: Checkpoint | str | os.PathLike, dtype="bfloat16", *,
               with_tokenizer: bool = True) -> LoadedModel:
    """Load config, params and tokenizer from an HF directory, a GGUF file or an Orbax checkpoint
    (``path``: see `checkpoints_tools.loader.detect_format`, or an opened `Checkpoint`).

    ``dtype``: "bfloat16", "float32" or a jnp dtype. ``with_tokenizer=False``: no tokenizer (token-id
    prompts only); EOS ids then come from the generation config and the model config.

    Raises:
        FileNotFoundError: ``path`` does not exist (named in the message).
        ValueError: an unsupported format or architecture (before any tokenizer is built), bad
            tensors, or no tokenizer.
    """
    ckpt = path if isinstance(path, Checkpoint) else open_checkpoint(path)
    cfg = model_config(ckpt)
    tokenizer = load_tokenizer(ckpt.path, ckpt.format) if with_tokenizer else None
    cfg, params = load_params(ckpt, dtype, cfg)
    groups = ((tokenizer.eos_token_id,) if tokenizer is not None else (),
              ckpt.generation_eos_ids, cfg.eos_token_ids)
    eos = tuple(dict.fromkeys(int(t) for g in groups for t in g if t is not None))
    return LoadedModel(cfg, params, tokenizer, eos, ckpt.format)


def save_checkpoint(dst: str | os.PathLike, cfg: ModelConfig, params, tokenizer,
                    eos_ids) -> None:
    """Write an Orbax checkpoint that `load_model` reads back (`checkpoints_tools.orbax_io.save`:
    FileExistsError for a non-empty ``dst``, ValueError for params that do not fit ``cfg``)."""
    dtype = jax.tree_util.tree_leaves(params)[0].dtype
    orbax_io.save(dst, cfg.to_dict(), params, abstract_params(cfg, dtype), tokenizer, eos_ids)
