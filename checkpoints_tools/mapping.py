"""HF tensor names -> the jaxinfer param tree: ONE table, `HF_TO_PARAMS` (`IGNORED_HF`: skipped);
any other, missing, duplicate or wrongly shaped tensor is an error (DESIGN.md convention 9).
Tying (CASES.md C9): no ``lm_head.weight``, or one equal to the embedding -> tied (UserWarning if
``tie_word_embeddings`` disagrees). HF ``[out, in]`` -> ``[in, out]``; q/k/v_proj fill ``wqkv``,
gate/up ``w_gate_up``; HF FP8: matrices stay fp8, ``weight_scale_inv`` -> ``<param>_scale``.
MoE: each layer's rules are those of its leaves (a dense layer's MLP, or a sparse layer's router
and experts); expert j's gate/up/down_proj fill row j of the stacked [E, ...] leaves."""

import re
import warnings
from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple

import numpy as np


class TensorRule(NamedTuple):
    """One HF tensor -> one param entry (slash-separated tree path), or one ``part`` of a fused
    entry's output axis; ``{i}``: layer index; ``{j}``: expert index (row j of the param's leading
    E axis); ``transpose``: ``[out, in]`` -> ``[in, out]``."""

    hf_name: str
    param: str
    transpose: bool
    part: str | None = None

    per_layer = property(lambda self: "{i}" in self.hf_name)
    per_expert = property(lambda self: "{j}" in self.hf_name)
    leaf = property(lambda self: self.param.rsplit("/", 1)[-1])


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
    TensorRule(_L + "mlp.gate.weight", _P + "router", True),
    TensorRule(_L + "mlp.experts.{j}.gate_proj.weight", _P + "w_experts_gate_up", True, "gate"),
    TensorRule(_L + "mlp.experts.{j}.up_proj.weight", _P + "w_experts_gate_up", True, "up"),
    TensorRule(_L + "mlp.experts.{j}.down_proj.weight", _P + "w_experts_down", True),
    TensorRule("model.norm.weight", "final_norm", False),
    TensorRule("lm_head.weight", "lm_head", True),
)
# HF FP8 block scales ``<name>.weight_scale_inv`` [out/bo, in/bi] -> ``<param>_scale``.
HF_TO_PARAMS += tuple(
    TensorRule(r.hf_name + "_scale_inv", r.param + "_scale", True, r.part)
    for r in HF_TO_PARAMS
    if r.per_layer and r.transpose
)

# Non-parameter buffers (recomputed from the config).
IGNORED_HF: tuple[str, ...] = ("model.rotary_emb.inv_freq", _L + "self_attn.rotary_emb.inv_freq")

TensorSource = Mapping[str, np.ndarray] | Iterable[tuple[str, np.ndarray]]


def fp8_block_size(qc: Mapping[str, Any] | None) -> tuple[int, int] | None:
    """``weight_block_size`` (block_out, block_in) of an HF ``quantization_config`` (None: none).
    Raises ValueError: not quant_method "fp8" with dynamic activation scales and a block size."""
    if not qc:
        return None
    block = qc.get("weight_block_size")
    if (
        qc.get("quant_method") != "fp8"
        or qc.get("activation_scheme", "dynamic") != "dynamic"
        or not isinstance(block, (list, tuple))
        or len(block) != 2
    ):
        raise ValueError(
            f"quantization_config={dict(qc)} is not supported: only HF FP8 "
            "checkpoints (quant_method 'fp8', activation_scheme 'dynamic', "
            "weight_block_size [out, in])"
        )
    return int(block[0]), int(block[1])


def tree_mismatches(want, got, *, dtypes: bool = False, slash: bool = False) -> list[str]:
    """A line per leaf path (leaves with ``.shape``, ``.dtype``) where ``got`` differs from
    ``want``: ``"params<path> has shape (got), expected (want)"`` (``dtypes``: ``"is dtype[shape],
    ..."``), ``"is missing"``, ``"is unexpected"``. Paths: ``keystr``; ``slash``: ``/a/0``."""
    import jax

    def flat(tree):
        return {
            (
                "/" + jax.tree_util.keystr(k, simple=True, separator="/")
                if slash
                else jax.tree_util.keystr(k)
            ): v
            for k, v in jax.tree_util.tree_flatten_with_path(tree)[0]
        }

    def desc(a):
        shape = tuple(int(d) for d in getattr(a, "shape", ()))
        return f"{getattr(a, 'dtype', type(a).__name__)}{list(shape)}" if dtypes else f"{shape}"

    w, g = flat(want), flat(got)
    return [
        f"params{k} is missing"
        if k not in g
        else f"params{k} is unexpected"
        if k not in w
        else f"params{k} {'is' if dtypes else 'has shape'} {desc(g[k])}, expected {desc(w[k])}"
        for k in sorted(w.keys() | g.keys())
        if k not in g or k not in w or desc(g[k]) != desc(w[k])
    ]


def _pattern(template: str) -> re.Pattern:
    pattern = re.escape(template).replace(re.escape("{i}"), r"(\d+)")
    return re.compile(pattern.replace(re.escape("{j}"), r"(\d+)") + r"\Z")


def _spec(abstract: Mapping, param: str, layer: int = 0) -> tuple[tuple[int, ...], Any]:
    """(shape, dtype) of ``param`` (at ``layer`` for ``{i}``); absent ``lm_head``: embed's
    transposed."""
    if param == "lm_head" and "lm_head" not in abstract:
        return tuple(reversed(abstract["embed"].shape)), abstract["embed"].dtype
    leaf = abstract
    for key in param.format(i=layer).split("/"):
        leaf = leaf[key]
    return tuple(leaf.shape), leaf.dtype


def hf_shape(rule: TensorRule, abstract: Mapping, parts: Mapping, layer: int = 0) -> tuple:
    """The shape HF gives ``rule``'s tensor (``[out, in]``; a fused part's width on out; one
    expert's: without the leading E axis) at layer ``layer``."""
    shape, _ = _spec(abstract, rule.param, layer)
    shape = shape[1:] if rule.per_expert else shape
    if rule.part is not None:
        shape = (*shape[:-1], (sl := parts[rule.leaf][rule.part]).stop - sl.start)
    return tuple(reversed(shape)) if rule.transpose else shape


def _layers(rule: TensorRule, abstract: Mapping) -> list[int | None]:
    """The layers whose tree has ``rule``'s leaf ([None]: not a per-layer rule)."""
    if not rule.per_layer:
        return [None]
    return sorted(int(i) for i, leaves in abstract["layers"].items() if rule.leaf in leaves)


def _expected(rule: TensorRule, abstract: Mapping, cfg: Any) -> list[str]:
    """The HF names ``rule`` must find: per layer with its leaf, per expert j < E."""
    experts = range(getattr(cfg, "num_experts", 0)) if rule.per_expert else [0]
    return [rule.hf_name.format(i=i, j=j) for i in _layers(rule, abstract) for j in experts]


def _match(name: str, rules, abstract: Mapping, cfg: Any) -> tuple[Any, int | None]:
    """(rule, layer) of tensor ``name``; (None, None) for an ignored buffer. ValueError: no rule,
    a layer index >= L or an expert index >= E, a leaf that layer does not have (e.g. a dense
    MLP's tensor on an MoE layer)."""
    if any(_pattern(t).match(name) for t in IGNORED_HF):
        return None, None
    for r in rules:
        if m := _pattern(r.hf_name).match(name):
            layer = int(m.group(1)) if r.per_layer else None
            expert = int(m.group(2)) if r.per_expert else 0
            bad = (
                f"layer index {layer} >= num_layers={cfg.num_layers}"
                if layer is not None and layer >= cfg.num_layers
                else f"expert index {expert} >= num_experts={getattr(cfg, 'num_experts', 0)}"
                if r.per_expert and expert >= cfg.num_experts
                else f"layer {layer} has no param {r.leaf!r}"
                if layer is not None and layer not in _layers(r, abstract)
                else None
            )
            if bad:
                raise ValueError(f"unexpected tensor {name!r} in checkpoint: {bad}")
            return r, layer
    raise ValueError(
        f"unexpected tensor {name!r} in checkpoint: no entry in the mapping table "
        f"for architecture {cfg.architecture!r}"
    )


def _collect(tensors: TensorSource, rules, abstract: Mapping, parts: Mapping, cfg: Any) -> dict:
    """``{hf_name: array}`` after the name, duplicate, shape and completeness checks."""
    found: dict[str, Any] = {}
    for name, array in tensors.items() if isinstance(tensors, Mapping) else tensors:
        if name in found:
            raise ValueError(
                f"duplicate tensor {name!r}: given more than once (e.g. in two shards)"
            )
        rule, layer = _match(name, rules, abstract, cfg)
        if rule is not None:
            at = layer or 0
            array, want = np.asarray(array), hf_shape(rule, abstract, parts, at)
            fp8 = np.dtype(_spec(abstract, rule.param, at)[1]).name == "float8_e4m3fn"
            if tuple(array.shape) != want or (fp8 and array.dtype.name != "float8_e4m3fn"):
                where = rule.param.format(i=layer) + (f" part {rule.part!r}" if rule.part else "")
                raise ValueError(
                    f"tensor {name!r} has shape {tuple(array.shape)} ({array.dtype})"
                    f", expected {want}{' in float8_e4m3fn' * fp8} (for param "
                    f"{where!r} of {cfg.architecture} config)"
                )
        found[name] = array if rule is not None else None  # ignored: kept for duplicate checks
    missing = [
        n
        for r in rules
        if r.param != "lm_head"
        for n in _expected(r, abstract, cfg)
        if n not in found
    ]
    if missing:
        raise ValueError(f"missing tensors in checkpoint ({len(missing)}): {missing}")
    return found


def hf_tensors_to_params(
    tensors: TensorSource, cfg: Any, abstract: Mapping, parts: Mapping, on_host: bool = False
) -> dict:
    """The param tree (jax arrays in each abstract leaf's dtype; numpy with ``on_host``; ``lm_head``
    iff untied) from HF-named ``tensors`` (a dict or ``(name, array)`` pairs). cfg: duck-typed
    ``num_layers``, ``architecture``, ``tie_word_embeddings`` (MoE: ``num_experts``); abstract:
    the ShapeDtypeStruct tree (rules of leaves absent from it, or from a layer, skipped there);
    parts: ``{fused param: {part: slice of its last axis}}``. ValueError: unmapped, duplicate or
    missing tensor, bad shape. UserWarning: tying."""
    import jax.numpy as jnp

    rules = [
        r
        for r in HF_TO_PARAMS
        if r.param == "lm_head" or (_layers(r, abstract) if r.per_layer else r.param in abstract)
    ]
    found = _collect(tensors, rules, abstract, parts, cfg)
    tied = _decide_tying(found, cfg)
    params: dict = {}
    xp = np if on_host else jnp
    for path in dict.fromkeys(r.param for r in rules if not (r.param == "lm_head" and tied)):
        group = [r for r in rules if r.param == path]  # fused parts in table order
        for i in _layers(group[0], abstract):
            shape, dtype = _spec(abstract, path, i or 0)
            experts = range(cfg.num_experts) if group[0].per_expert else [None]
            leaves = [
                _fuse(
                    [(r, found.pop(r.hf_name.format(i=i, j=j))) for r in group],
                    parts,
                    shape[1:] if j is not None else shape,
                    np.dtype(dtype),
                    xp,
                )
                for j in experts
            ]
            node = params
            *parents, leaf = path.format(i=i).split("/")
            for key in parents:
                node = node.setdefault(key, {})
            node[leaf] = leaves[0] if experts == [None] else xp.stack(leaves)
            del leaves
    return params


def _fuse(pieces, parts: Mapping, shape, dtype, xp):
    """One leaf [in, out] of ``dtype`` from its ``(rule, HF tensor)`` pieces, each transposed if
    its rule says so, concatenated along the last axis in their ``parts`` order. ``xp``: numpy
    (host: one C-contiguous copy in `aligned_empty` memory) or jax.numpy: then each piece goes to
    the device as stored and is transposed there (NumPy's strided transpose of an 8B model's
    bfloat16 weights takes over a minute)."""
    ordered = sorted(pieces, key=lambda p: parts[p[0].leaf][p[0].part].start if p[0].part else 0)
    arrays = [xp.asarray(p).astype(dtype, copy=False) for _, p in ordered]
    arrays = [a.T if r.transpose else a for a, (r, _) in zip(arrays, ordered)]
    if xp is np:
        out = aligned_empty(shape, dtype)
        np.concatenate(arrays, axis=-1, out=out)
    else:
        out = arrays[0] if len(arrays) == 1 else xp.concatenate(arrays, axis=-1)
    assert tuple(out.shape) == tuple(shape), (out.shape, shape)
    return out


def aligned_empty(shape, dtype) -> np.ndarray:
    """An uninitialised C-contiguous array whose data starts on a 64-byte boundary, memory that
    `jax.device_put` on the CPU keeps as its buffer (no copy)."""
    size = int(np.prod(shape)) * np.dtype(dtype).itemsize
    raw = np.empty(size + 64, np.uint8)
    start = -raw.ctypes.data % 64
    return raw[start : start + size].view(dtype).reshape(shape)


def _decide_tying(found: Mapping[str, np.ndarray], cfg: Any) -> bool:
    if (head := found.get("lm_head.weight")) is None:
        if not cfg.tie_word_embeddings:
            warnings.warn(
                "config says tie_word_embeddings=False but the checkpoint has no "
                "'lm_head.weight'; using the embedding as the output head",
                stacklevel=4,
            )
        return True
    embed = found["model.embed_tokens.weight"]
    if np.array_equal(head[:1], embed[:1]) and np.array_equal(head, embed):  # first row: fast no
        return True
    if cfg.tie_word_embeddings:
        warnings.warn(
            "config says tie_word_embeddings=True but 'lm_head.weight' differs from "
            "'model.embed_tokens.weight'; using the checkpoint's lm_head (untied)",
            stacklevel=4,
        )
    return False
