"""HF transformers tensor names -> the jaxinfer param tree: ONE explicit table, with shape checks.

Every checkpoint tensor must be either mapped by `HF_TO_PARAMS` or listed in `IGNORED_HF`; anything
else is an error, as is a missing or duplicate tensor or a wrong shape (DESIGN.md convention 9,
after jax-llm-examples' converter). Tied output embeddings are decided from the tensors present,
not only from the config (CASES.md C9):

    no ``lm_head.weight``                       -> tied (warns if the config said untied)
    ``lm_head.weight`` equal to the embedding   -> tied (one copy kept)
    ``lm_head.weight`` differing, config tied   -> warning, untied (the checkpoint's head is used)
    ``lm_head.weight`` differing, config untied -> untied

HF stores linear weights as ``[out, in]``; the tree stores ``[in, out]`` (see
`jaxinfer.models.params`), so those are transposed here, once, in numpy.
"""

from __future__ import annotations

import dataclasses
import re
import warnings
from dataclasses import dataclass
from typing import Iterable, Iterator, Mapping, Union

import jax.numpy as jnp
import numpy as np

from jaxinfer.config import ModelConfig
from jaxinfer.models.params import param_shapes


@dataclass(frozen=True)
class TensorRule:
    """One HF tensor -> one param entry.

    hf_name: the HF name; ``{i}`` stands for the layer index (then ``param`` is a stacked
        ``layers/...`` entry and the tensor is its slice ``[i]``).
    param: slash-separated path in the param tree, e.g. ``layers/wq``.
    transpose: HF ``[out, in]`` -> tree ``[in, out]``.
    qk_norm_only: only present in architectures with ``cfg.qk_norm`` (Qwen3).
    """

    hf_name: str
    param: str
    transpose: bool
    qk_norm_only: bool = False

    @property
    def per_layer(self) -> bool:
        return "{i}" in self.hf_name


_L = "model.layers.{i}."
HF_TO_PARAMS: tuple[TensorRule, ...] = (
    TensorRule("model.embed_tokens.weight", "embed", False),
    TensorRule(_L + "input_layernorm.weight", "layers/attn_norm", False),
    TensorRule(_L + "self_attn.q_proj.weight", "layers/wq", True),
    TensorRule(_L + "self_attn.k_proj.weight", "layers/wk", True),
    TensorRule(_L + "self_attn.v_proj.weight", "layers/wv", True),
    TensorRule(_L + "self_attn.o_proj.weight", "layers/wo", True),
    TensorRule(_L + "self_attn.q_norm.weight", "layers/q_norm", False, qk_norm_only=True),
    TensorRule(_L + "self_attn.k_norm.weight", "layers/k_norm", False, qk_norm_only=True),
    TensorRule(_L + "post_attention_layernorm.weight", "layers/mlp_norm", False),
    TensorRule(_L + "mlp.gate_proj.weight", "layers/w_gate", True),
    TensorRule(_L + "mlp.up_proj.weight", "layers/w_up", True),
    TensorRule(_L + "mlp.down_proj.weight", "layers/w_down", True),
    TensorRule("model.norm.weight", "final_norm", False),
    TensorRule("lm_head.weight", "lm_head", True),
)

# Non-parameter buffers some checkpoints carry; recomputed from the config, so skipped.
IGNORED_HF: tuple[str, ...] = (
    "model.rotary_emb.inv_freq",
    _L + "self_attn.rotary_emb.inv_freq",
)

TensorSource = Union[Mapping[str, np.ndarray], Iterable[tuple[str, np.ndarray]]]


def _pattern(template: str) -> re.Pattern:
    return re.compile(re.escape(template).replace(re.escape("{i}"), r"(\d+)") + r"\Z")


def _items(tensors: TensorSource) -> Iterator[tuple[str, np.ndarray]]:
    if isinstance(tensors, Mapping):
        return iter(tensors.items())
    return iter(tensors)


def _get(tree: dict, path: str):
    for part in path.split("/"):
        tree = tree[part]
    return tree


def _set(tree: dict, path: str, value) -> None:
    *parents, leaf = path.split("/")
    for part in parents:
        tree = tree.setdefault(part, {})
    tree[leaf] = value


def hf_tensors_to_params(tensors: TensorSource, cfg: ModelConfig,
                         dtype) -> tuple[dict, ModelConfig]:
    """Map HF-named tensors onto the jaxinfer param tree, checking names and shapes.

    Args:
        tensors: a mapping ``name -> array`` or an iterable of ``(name, array)`` pairs (numpy or
            anything ``np.asarray`` accepts; bf16 via ml_dtypes). Pairs let a multi-file loader have
            duplicates detected here.
        cfg: the config from ``config.json``; its ``tie_word_embeddings`` is re-decided from the
            tensors (module docstring).
        dtype: dtype of the returned device arrays (e.g. ``jnp.float32``, ``jnp.bfloat16``).
    Returns:
        (params: the tree of `jaxinfer.models.params` as jax arrays of ``dtype`` on the default
        device; cfg, possibly with ``tie_word_embeddings`` replaced).
    Raises:
        ValueError: a tensor not in the table (unmapped), a tensor given twice (duplicate), a wrong
            shape (both shapes named), or missing tensors (all named).
    Warns:
        UserWarning: the config's ``tie_word_embeddings`` disagrees with the tensors.
    """
    untied_cfg = dataclasses.replace(cfg, tie_word_embeddings=False)
    shapes = param_shapes(untied_cfg)
    rules = [r for r in HF_TO_PARAMS if cfg.qk_norm or not r.qk_norm_only]
    compiled = [(_pattern(r.hf_name), r) for r in rules]
    ignored = [_pattern(t) for t in IGNORED_HF]
    L = cfg.num_layers

    found: dict[str, np.ndarray] = {}
    for name, array in _items(tensors):
        if name in found:
            raise ValueError(f"duplicate tensor {name!r}: given more than once (e.g. in two shards)")
        if any(p.match(name) for p in ignored):
            found[name] = None  # remembered only for the duplicate check
            continue
        rule, layer = None, None
        for pat, r in compiled:
            m = pat.match(name)
            if m:
                rule, layer = r, (int(m.group(1)) if r.per_layer else None)
                break
        if rule is None or (layer is not None and layer >= L):
            why = (f"layer index {layer} >= num_layers={L}" if rule is not None
                   else f"no entry in the mapping table for architecture {cfg.architecture!r}")
            raise ValueError(f"unexpected tensor {name!r} in checkpoint: {why}")
        array = np.asarray(array)
        want = _get(shapes, rule.param)
        want = want[1:] if rule.per_layer else want
        want = tuple(reversed(want)) if rule.transpose else tuple(want)
        if tuple(array.shape) != want:
            raise ValueError(f"tensor {name!r} has shape {tuple(array.shape)}, expected {want} "
                             f"(for param {rule.param!r} of {cfg.architecture} config)")
        found[name] = array

    expected = []
    for r in rules:
        if r.param == "lm_head":
            continue
        expected += [r.hf_name.format(i=i) for i in range(L)] if r.per_layer else [r.hf_name]
    missing = [n for n in expected if n not in found]
    if missing:
        raise ValueError(f"missing tensors in checkpoint ({len(missing)}): {missing}")

    tied = _decide_tying(found, cfg)
    out_cfg = dataclasses.replace(cfg, tie_word_embeddings=tied)

    params: dict = {}
    for r in rules:
        if r.param == "lm_head" and tied:
            continue
        if r.per_layer:
            pieces = [found.pop(r.hf_name.format(i=i)) for i in range(L)]
            host = np.stack([p.T if r.transpose else p for p in pieces])
            del pieces
        else:
            p = found.pop(r.hf_name)
            host = np.ascontiguousarray(p.T) if r.transpose else p
        _set(params, r.param, jnp.asarray(host).astype(dtype))
        del host
    return params, out_cfg


def _decide_tying(found: Mapping[str, np.ndarray], cfg: ModelConfig) -> bool:
    """Tied iff there is no lm_head or it equals the embedding; warns on config disagreement."""
    head = found.get("lm_head.weight")
    if head is None:
        if not cfg.tie_word_embeddings:
            warnings.warn("config says tie_word_embeddings=False but the checkpoint has no "
                          "'lm_head.weight'; using the embedding as the output head", stacklevel=3)
        return True
    if np.array_equal(head, found["model.embed_tokens.weight"]):
        return True
    if cfg.tie_word_embeddings:
        warnings.warn("config says tie_word_embeddings=True but 'lm_head.weight' differs from "
                      "'model.embed_tokens.weight'; using the checkpoint's lm_head (untied)",
                      stacklevel=3)
    return False


def hf_name_for(param: str, layer: int | None = None) -> str:
    """The HF tensor name of a tree entry (``layers/...`` entries need ``layer``).

    Raises:
        ValueError: an unknown param path, or a layer index missing/extra.
    """
    for r in HF_TO_PARAMS:
        if r.param == param:
            if r.per_layer != (layer is not None):
                raise ValueError(f"param {param!r}: layer={layer!r} but per_layer={r.per_layer}")
            return r.hf_name.format(i=layer) if r.per_layer else r.hf_name
    raise ValueError(f"unknown param path {param!r}; known: {[r.param for r in HF_TO_PARAMS]}")
