"""HF transformers tensor names -> the jaxinfer param tree: ONE explicit table, with shape checks.

Every checkpoint tensor must be either mapped by `HF_TO_PARAMS` or listed in `IGNORED_HF`; anything
else is an error, as is a missing or duplicate tensor or a wrong shape (DESIGN.md convention 9,
after jax-llm-examples' converter). Shapes and dtypes come from an abstract tree (a pytree of
``jax.ShapeDtypeStruct``) that the caller passes in; this module knows no model code. Tied output
embeddings are decided from the tensors present, not only from the config (CASES.md C9):

    no ``lm_head.weight``                       -> tied (warns if the config said untied)
    ``lm_head.weight`` equal to the embedding   -> tied (one copy kept)
    ``lm_head.weight`` differing, config tied   -> warning, untied (the checkpoint's head is used)
    ``lm_head.weight`` differing, config untied -> untied

HF stores linear weights as ``[out, in]``; the tree stores ``[in, out]``, so those are transposed
here, once, in numpy. Per-layer tensors go to ``layers/<i>/...``. HF's q_proj/k_proj/v_proj become
the q | k | v parts of ``wqkv`` and gate_proj/up_proj the gate | up parts of ``w_gate_up``, placed
by the caller's ``parts`` (``jaxinfer.models.fused_parts(cfg)``).
"""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Mapping, Union

import numpy as np


@dataclass(frozen=True)
class TensorRule:
    """One HF tensor -> one param entry, or one part of a fused param entry.

    hf_name: the HF name; ``{i}`` stands for the layer index (then ``param`` holds ``{i}`` too).
    param: slash-separated path in the param tree, e.g. ``layers/{i}/wo``.
    transpose: HF ``[out, in]`` -> tree ``[in, out]``.
    part: for a fused param (``wqkv``, ``w_gate_up``), which part of its output axis this tensor
        fills (a key of ``parts[<param name>]``); None for a whole param.
    """

    hf_name: str
    param: str
    transpose: bool
    part: str | None = None

    @property
    def per_layer(self) -> bool:
        return "{i}" in self.hf_name

    @property
    def leaf(self) -> str:
        """The param's own name (last path component), e.g. ``wqkv``."""
        return self.param.rsplit("/", 1)[-1]


_L, _P = "model.layers.{i}.", "layers/{i}/"
HF_TO_PARAMS: tuple[TensorRule, ...] = (
    TensorRule("model.embed_tokens.weight", "embed", False),
    TensorRule(_L + "input_layernorm.weight", _P + "attn_norm", False),
    TensorRule(_L + "self_attn.q_proj.weight", _P + "wqkv", True, part="q"),
    TensorRule(_L + "self_attn.k_proj.weight", _P + "wqkv", True, part="k"),
    TensorRule(_L + "self_attn.v_proj.weight", _P + "wqkv", True, part="v"),
    TensorRule(_L + "self_attn.o_proj.weight", _P + "wo", True),
    TensorRule(_L + "self_attn.q_norm.weight", _P + "q_norm", False),
    TensorRule(_L + "self_attn.k_norm.weight", _P + "k_norm", False),
    TensorRule(_L + "post_attention_layernorm.weight", _P + "mlp_norm", False),
    TensorRule(_L + "mlp.gate_proj.weight", _P + "w_gate_up", True, part="gate"),
    TensorRule(_L + "mlp.up_proj.weight", _P + "w_gate_up", True, part="up"),
    TensorRule(_L + "mlp.down_proj.weight", _P + "w_down", True),
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
    return iter(tensors.items()) if isinstance(tensors, Mapping) else iter(tensors)


def _leaf(tree: Mapping, path: str):
    for key in path.split("/"):
        tree = tree[key]
    return tree


def _rules(abstract: Mapping) -> list[TensorRule]:
    """The table's rules whose param exists in ``abstract`` (q_norm/k_norm only where the model
    has them); the lm_head rule always (tying is decided from the tensors)."""
    layer = abstract["layers"]["0"] if abstract["layers"] else {}
    return [r for r in HF_TO_PARAMS
            if r.param == "lm_head" or (r.leaf in layer if r.per_layer else r.param in abstract)]


def _spec(abstract: Mapping, param: str) -> tuple[tuple[int, ...], Any]:
    """(shape, dtype) of tree entry ``param`` (``{i}`` allowed); ``lm_head`` absent from the tree
    is the embedding transposed."""
    if param == "lm_head" and "lm_head" not in abstract:
        return tuple(reversed(abstract["embed"].shape)), abstract["embed"].dtype
    leaf = _leaf(abstract, param.format(i=0))
    return tuple(leaf.shape), leaf.dtype


def hf_shape(rule: TensorRule, abstract: Mapping, parts: Mapping) -> tuple[int, ...]:
    """The shape HF gives the tensor of ``rule`` (``[out, in]`` for linear weights); for a part of
    a fused param, the output axis is that part's width."""
    shape, _ = _spec(abstract, rule.param)
    if rule.part is not None:
        sl = parts[rule.leaf][rule.part]
        shape = (*shape[:-1], sl.stop - sl.start)
    return tuple(reversed(shape)) if rule.transpose else shape


def _match(name: str, compiled, ignored, num_layers: int, architecture: str):
    """(rule, layer) of tensor ``name``; (None, None) for an ignored buffer. Raises ValueError."""
    if any(p.match(name) for p in ignored):
        return None, None
    for pat, r in compiled:
        m = pat.match(name)
        if m:
            layer = int(m.group(1)) if r.per_layer else None
            if layer is not None and layer >= num_layers:
                raise ValueError(f"unexpected tensor {name!r} in checkpoint: layer index {layer} "
                                 f">= num_layers={num_layers}")
            return r, layer
    raise ValueError(f"unexpected tensor {name!r} in checkpoint: no entry in the mapping table "
                     f"for architecture {architecture!r}")


def _collect(tensors: TensorSource, rules: list[TensorRule], abstract: Mapping, parts: Mapping,
             cfg: Any) -> dict[str, np.ndarray]:
    """``{hf_name: array}`` after the name, duplicate, shape and completeness checks."""
    compiled = [(_pattern(r.hf_name), r) for r in rules]
    ignored = [_pattern(t) for t in IGNORED_HF]
    L = cfg.num_layers
    found: dict[str, np.ndarray | None] = {}
    for name, array in _items(tensors):
        if name in found:
            raise ValueError(f"duplicate tensor {name!r}: given more than once (e.g. in two shards)")
        rule, layer = _match(name, compiled, ignored, L, cfg.architecture)
        if rule is None:
            found[name] = None  # an ignored buffer, remembered only for the duplicate check
            continue
        array = np.asarray(array)
        want = hf_shape(rule, abstract, parts)
        if tuple(array.shape) != want:
            where = rule.param.format(i=layer) + (f" part {rule.part!r}" if rule.part else "")
            raise ValueError(f"tensor {name!r} has shape {tuple(array.shape)}, expected {want} "
                             f"(for param {where!r} of {cfg.architecture} config)")
        found[name] = array
    expected = [r.hf_name.format(i=i) for r in rules if r.param != "lm_head"
                for i in (range(L) if r.per_layer else [None])]
    missing = [n for n in expected if n not in found]
    if missing:
        raise ValueError(f"missing tensors in checkpoint ({len(missing)}): {missing}")
    return found


def hf_tensors_to_params(tensors: TensorSource, cfg: Any, abstract: Mapping,
                         parts: Mapping) -> dict:
    """Map HF-named tensors onto the param tree, checking names and shapes.

    Args:
        tensors: a mapping ``name -> array`` or an iterable of ``(name, array)`` pairs (numpy or
            anything ``np.asarray`` accepts; bf16 via ml_dtypes). Pairs let a multi-file loader have
            duplicates detected here.
        cfg: duck-typed model config: ``num_layers``, ``architecture`` and the config's
            ``tie_word_embeddings`` (only compared with the tensors, module docstring).
        abstract: the ``jax.ShapeDtypeStruct`` tree of the model (``layers/"0".."L-1"/...``); an
            ``lm_head`` leaf in it is optional (its shape is the embedding's, transposed).
        parts: ``{fused param: {part: slice of its output axis}}`` (``jaxinfer.models.fused_parts``).
    Returns:
        the param tree as jax arrays on the default device, each of its abstract leaf's dtype;
        ``lm_head`` present iff the head is untied.
    Raises:
        ValueError: a tensor not in the table (unmapped), a tensor given twice (duplicate), a wrong
            shape (both shapes named), or missing tensors (all named).
    Warns:
        UserWarning: the config's ``tie_word_embeddings`` disagrees with the tensors.
    """
    import jax.numpy as jnp

    rules = _rules(abstract)
    found = _collect(tensors, rules, abstract, parts, cfg)
    tied = _decide_tying(found, cfg)
    groups: dict[str, list[TensorRule]] = {}  # param path -> its rule(s), fused parts in order
    for r in rules:
        if not (r.param == "lm_head" and tied):
            groups.setdefault(r.param, []).append(r)
    params: dict = {}
    for path, group in groups.items():
        shape, dtype = _spec(abstract, path)
        for i in range(cfg.num_layers) if group[0].per_layer else [None]:
            pieces = [found.pop(r.hf_name.format(i=i)) for r in group]
            host = _assemble(group, pieces, shape, parts)
            del pieces
            node = params
            *parents, leaf = path.format(i=i).split("/")
            for key in parents:
                node = node.setdefault(key, {})
            node[leaf] = jnp.asarray(host).astype(dtype)
            del host
    return params


def _assemble(rules: list[TensorRule], pieces: list[np.ndarray], shape: tuple[int, ...],
              parts: Mapping) -> np.ndarray:
    """One param entry on the host, ``[in, out]``, from its HF tensor(s): a whole tensor
    (transposed if its rule says so), or the parts of a fused param placed on its output axis."""
    if rules[0].part is None:
        p = pieces[0]
        return np.ascontiguousarray(p.T) if rules[0].transpose else p
    where = parts[rules[0].leaf]
    host = np.empty(shape, np.result_type(*pieces))
    for r, p in zip(rules, pieces):
        host[..., where[r.part]] = p.T if r.transpose else p
    return host


def _decide_tying(found: Mapping[str, np.ndarray], cfg: Any) -> bool:
    """Tied iff there is no lm_head or it equals the embedding; warns on config disagreement."""
    head = found.get("lm_head.weight")
    if head is None:
        if not cfg.tie_word_embeddings:
            warnings.warn("config says tie_word_embeddings=False but the checkpoint has no "
                          "'lm_head.weight'; using the embedding as the output head", stacklevel=4)
        return True
    if np.array_equal(head, found["model.embed_tokens.weight"]):
        return True
    if cfg.tie_word_embeddings:
        warnings.warn("config says tie_word_embeddings=True but 'lm_head.weight' differs from "
                      "'model.embed_tokens.weight'; using the checkpoint's lm_head (untied)",
                      stacklevel=4)
    return False


def hf_name_for(param: str, layer: int | None = None, part: str | None = None) -> str:
    """The HF tensor name of a tree entry, e.g. ``hf_name_for("layers/{i}/wqkv", 3, "k")`` ->
    ``model.layers.3.self_attn.k_proj.weight`` (per-layer entries need ``layer``; fused entries
    need ``part``).

    Raises:
        ValueError: an unknown param path or part, or a layer index missing/extra.
    """
    for r in HF_TO_PARAMS:
        if r.param == param and r.part == part:
            if r.per_layer != (layer is not None):
                raise ValueError(f"param {param!r}: layer={layer!r} but per_layer={r.per_layer}")
            return r.hf_name.format(i=layer) if r.per_layer else r.hf_name
    raise ValueError(f"unknown param path {param!r} with part={part!r}; known: "
                     f"{[(r.param, r.part) for r in HF_TO_PARAMS]}")
