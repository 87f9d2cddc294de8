"""A model from a checkpoint: `load_model(path, dtype) -> LoadedModel`; `checkpoints_tools` reads
the files and maps tensor names onto `jaxinfer.models.abstract_params`. EOS ids (CASES.md C4): the
union, first-seen order, of the tokenizer's, the generation config's and the config's. A GGUF file
is mapped once in float32 and kept in its `checkpoints_tools.gguf_cache` entry (`_convert_gguf`);
later loads read that param tree (`cached_params`)."""

import dataclasses
import os
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from checkpoints_tools import gguf_cache, orbax_io
from checkpoints_tools.loader import Checkpoint, hf_tensors, load_tokenizer, open_checkpoint
from checkpoints_tools.mapping import TensorSource, hf_tensors_to_params, tree_mismatches
from jaxinfer.config import ModelConfig
from jaxinfer.models import abstract_params, fused_parts
from jaxinfer.models.quantize import quantize_params


class LoadedModel(NamedTuple):
    """config (tying decided from the tensors); params (``dtype`` jax arrays; ``on_host``: numpy);
    tokenizer (HF, or None); eos_token_ids (module docstring); source: the format."""

    config: ModelConfig
    params: Any
    tokenizer: Any
    eos_token_ids: tuple[int, ...]
    source: str


def params_from_hf(
    tensors: TensorSource, cfg: ModelConfig, dtype, on_host: bool = False
) -> tuple[dict, ModelConfig]:
    """``(params, cfg with tying decided)`` from HF-named tensors; FP8 checkpoints stay fp8."""
    untied, parts = dataclasses.replace(cfg, tie_word_embeddings=False), fused_parts(cfg)
    if bo := cfg.weight_block_size and cfg.weight_block_size[0]:  # block scales' parts: bounds / bo
        for m, p, n in ((m, p, s.stop - s.start) for m, ps in parts.items() for p, s in ps.items()):
            if n % bo:
                raise ValueError(
                    f"{m} part {p!r} has {n} output rows, not a multiple of "
                    f"weight_block_size's {bo}: its FP8 block scales cannot be fused"
                )
        parts |= {
            m + "_scale": {p: slice(s.start // bo, s.stop // bo) for p, s in ps.items()}
            for m, ps in parts.items()
        }
    params = hf_tensors_to_params(
        tensors, cfg, abstract_params(untied, dtype, bo and "fp8"), parts, on_host
    )
    return params, dataclasses.replace(cfg, tie_word_embeddings="lm_head" not in params)


def _flat(tree: dict, prefix: str = "") -> dict:
    """{slash-separated path: leaf} of a nested dict."""
    out = {}
    for k, v in tree.items():
        out |= _flat(v, f"{prefix}{k}/") if isinstance(v, dict) else {prefix + k: v}
    return out


def _cast(params: dict, dtype, on_host: bool) -> dict:
    """Every leaf in ``dtype`` (unquantised params declare every leaf in the compute dtype):
    numpy leaves with ``on_host``, else jax arrays."""
    dt = np.dtype(jnp.dtype(dtype))
    if on_host:
        return jax.tree.map(lambda a: np.asarray(a).astype(dt, copy=False), params)
    return jax.tree.map(lambda a: jnp.asarray(a, dt), params)


def cached_params(flat: dict, cfg: ModelConfig, dtype, on_host: bool, where: str):
    """``(params in dtype, cfg with tying decided)`` from a `gguf_cache` entry's ``flat`` float32
    tree (`gguf_cache.read_params` of directory ``where``); tied iff it has no ``lm_head``.
    ValueError: its paths or shapes do not fit ``cfg``'s params (named, with the entry to
    delete)."""
    params: dict = {}
    for path, a in flat.items():
        *parents, leaf = path.split("/")
        node = params
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = a
    cfg = dataclasses.replace(cfg, tie_word_embeddings="lm_head" not in params)
    if bad := tree_mismatches(abstract_params(cfg), params, slash=True):
        raise ValueError(
            f"the converted GGUF model in {where!r} does not fit this model's params "
            f"({'; '.join(bad[:3])}): delete that directory to convert the GGUF file again"
        )
    return _cast(params, dtype, on_host), cfg


def _convert_gguf(ckpt: Checkpoint, cfg: ModelConfig, tokenizer, dtype, on_host: bool):
    """``(params in dtype, cfg)`` of uncached GGUF ``ckpt``: dequantised and mapped once in
    float32 (by NumPy when the device is the CPU: its arrays then become the device buffers),
    that tree stored in its `gguf_cache` entry with ``tokenizer`` (the tensors written by a
    background thread; on the CPU from the device buffers themselves), then cast."""
    host = on_host or jax.default_backend() == "cpu"
    params, cfg = params_from_hf(hf_tensors(ckpt, np.float32), cfg, jnp.float32, host)
    flat = {k: np.asarray(v) for k, v in _flat(params).items()}  # CPU: no copy
    gguf_cache.store(ckpt, tokenizer, flat, wait=False)
    if host and not on_host:  # `mapping.aligned_empty` leaves: the CPU keeps them (no copy)
        params = jax.tree.map(jax.device_put, params)
    return (params if jnp.dtype(dtype) == jnp.float32 else _cast(params, dtype, on_host)), cfg


def load_params(
    ckpt: Checkpoint | str | os.PathLike,
    dtype,
    cfg: ModelConfig | None = None,
    on_host: bool = False,
    quantization: str | None = None,
) -> tuple[ModelConfig, dict]:
    """``(config, params)`` of a checkpoint (opened, or a path) in ``dtype``; ``cfg``: its config if
    built; ``on_host``: numpy leaves (`parallel.shard_params`); ``quantization`` "fp8":
    `quantize_params` after mapping. A `gguf_cache` entry: its param tree (`cached_params`).
    FileNotFoundError, ValueError: the reader's, mapping's."""
    ckpt = ckpt if isinstance(ckpt, Checkpoint) else open_checkpoint(ckpt)
    cfg = cfg or ModelConfig.from_checkpoint(ckpt)
    if ckpt.format == "orbax":
        params = orbax_io.restore(ckpt.path, abstract_params(cfg, dtype), on_host)
    elif ckpt.format == "hf" and (flat := gguf_cache.read_params(ckpt.path)) is not None:
        params, cfg = cached_params(flat, cfg, dtype, on_host, ckpt.path)
    else:
        params, cfg = params_from_hf(
            hf_tensors(ckpt, np.dtype(jnp.dtype(dtype))), cfg, dtype, on_host
        )
    if quantization is not None:
        params = quantize_params(params, cfg.weight_block_size)
    return cfg, params


def load_model(
    path: Checkpoint | str | os.PathLike,
    dtype="bfloat16",
    *,
    with_tokenizer: bool = True,
    tokenizer: str | None = None,
    on_host: bool = False,
    quantization: str | None = None,
) -> LoadedModel:
    """Config, params and tokenizer of a checkpoint (a path, `detect_format`, or an opened
    `Checkpoint`); ``dtype``: "bfloat16", "float32" or a jnp dtype; ``with_tokenizer=False``: none;
    ``tokenizer``: an HF tokenizer dir or GGUF file instead of the checkpoint's; ``on_host``,
    ``quantization``: `load_params`. A GGUF file with its own tokenizer is converted once into its
    `gguf_cache` entry (`_convert_gguf`). FileNotFoundError: no ``path`` (named); ValueError:
    unsupported format or architecture (before any tokenizer is built), bad tensors, or no
    tokenizer."""
    ckpt = path if isinstance(path, Checkpoint) else open_checkpoint(path)
    cfg = ModelConfig.from_checkpoint(ckpt)
    own = tokenizer is None  # the checkpoint's own
    tokenizer = (
        None
        if not with_tokenizer
        else load_tokenizer(ckpt)
        if own
        else load_tokenizer(tokenizer, "gguf" if str(tokenizer).endswith(".gguf") else "hf")
    )
    if ckpt.format == "gguf" and own and tokenizer is not None and gguf_cache.wanted(ckpt):
        params, cfg = _convert_gguf(ckpt, cfg, tokenizer, dtype, on_host)
        if quantization is not None:
            params = quantize_params(params, cfg.weight_block_size)
    else:
        cfg, params = load_params(ckpt, dtype, cfg, on_host, quantization)
    groups = (
        (tokenizer.eos_token_id,) if tokenizer is not None else (),
        ckpt.generation_eos_ids,
        cfg.eos_token_ids,
    )
    eos = tuple(dict.fromkeys(int(t) for g in groups for t in g if t is not None))
    return LoadedModel(cfg, params, tokenizer, eos, ckpt.format)
