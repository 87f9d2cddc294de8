"""EAGLE-3 draft heads in the HF layout vLLM and SpecForge write (architecture
``LlamaForCausalLMEagle3``; vLLM's ``vllm/model_executor/models/llama_eagle3.py``, SpecForge's
``specforge/modeling/draft/llama3_eagle.py``): config.json plus safetensors, read into numpy
tensors in the engine's layout by one name table (`TABLE`) with shape checks. Imports nothing
from jaxinfer.

Shape letters: D the head's (= the target's) width, F its FFN width, N/K/H its heads, V the
target's vocabulary, Vd ``draft_vocab_size``. HF tensors are ``[out, in]``; ours ``[in, out]``."""

import os
from collections.abc import Mapping
from typing import Any, NamedTuple

import numpy as np

from checkpoints_tools.loader import iter_tensors, read_json

ARCHITECTURE = "LlamaForCausalLMEagle3"
OPTIONAL = ("embed_tokens.weight", "t2d")  # the target's embedding is shared without the first


class Rule(NamedTuple):
    """HF tensor ``name`` -> our leaf ``leaf`` (fused leaves: ``part`` of ``parts`` columns);
    ``shape``: the HF shape from the dims dict (`dims`)."""

    name: str
    leaf: str
    shape: Any
    part: int = 0
    parts: int = 1


def _w(name, leaf, shape, part=0, parts=1):
    return Rule(name, leaf, shape, part, parts)


ATTN, MLP = "midlayer.self_attn.", "midlayer.mlp."
TABLE = (
    _w("fc.weight", "fc", lambda d: (d["D"], 3 * d["Dt"])),
    _w("midlayer.hidden_norm.weight", "hidden_norm", lambda d: (d["D"],)),
    _w("midlayer.input_layernorm.weight", "input_norm", lambda d: (d["D"],)),
    _w("midlayer.post_attention_layernorm.weight", "post_norm", lambda d: (d["D"],)),
    _w(ATTN + "q_proj.weight", "wqkv", lambda d: (d["N"] * d["H"], 2 * d["D"]), 0, 3),
    _w(ATTN + "k_proj.weight", "wqkv", lambda d: (d["K"] * d["H"], 2 * d["D"]), 1, 3),
    _w(ATTN + "v_proj.weight", "wqkv", lambda d: (d["K"] * d["H"], 2 * d["D"]), 2, 3),
    _w(ATTN + "o_proj.weight", "wo", lambda d: (d["D"], d["N"] * d["H"])),
    _w(MLP + "gate_proj.weight", "w_gate_up", lambda d: (d["F"], d["D"]), 0, 2),
    _w(MLP + "up_proj.weight", "w_gate_up", lambda d: (d["F"], d["D"]), 1, 2),
    _w(MLP + "down_proj.weight", "w_down", lambda d: (d["D"], d["F"])),
    _w("norm.weight", "norm", lambda d: (d["D"],)),
    _w("lm_head.weight", "lm_head", lambda d: (d["Vd"], d["D"])),
    _w("d2t", "d2t", lambda d: (d["Vd"],)),
    _w("t2d", "", lambda d: (d["V"],)),  # bool[V], target ids the head can propose: unused
    _w("embed_tokens.weight", "embed", lambda d: (d["V"], d["D"])),
)


class Eagle3Checkpoint(NamedTuple):
    """A read head: ``config`` (config.json), ``aux_layers`` (the target layers whose input
    streams ``fc`` takes, `aux_layer_ids`), ``tensors`` (our leaf -> numpy array, `to_leaves`)."""

    config: dict
    aux_layers: tuple[int, ...]
    tensors: dict


def is_eagle3(config: Mapping) -> bool:
    """Whether an HF config.json names the EAGLE-3 architecture."""
    return ARCHITECTURE in (config.get("architectures") or ())


def dims(config: Mapping, target_hidden: int, target_vocab: int) -> dict:
    """The dims of `TABLE`'s shapes from config.json: D, F, N, K, H, V, Vd (``draft_vocab_size``,
    default V) and Dt (``target_hidden_size``, default D). ValueError: a missing key (named), or
    D, Dt, V other than the target's ``target_hidden`` / ``target_vocab`` (both sizes named)."""
    try:
        n = int(config["num_attention_heads"])
        d = dict(
            D=int(config["hidden_size"]),
            F=int(config["intermediate_size"]),
            N=n,
            K=int(config.get("num_key_value_heads") or n),
            H=int(config.get("head_dim") or int(config["hidden_size"]) // n),
            V=int(config["vocab_size"]),
        )
    except KeyError as e:
        raise ValueError(f"EAGLE-3 config.json lacks the required key {e.args[0]!r}") from None
    d["Vd"] = int(config.get("draft_vocab_size") or d["V"])
    d["Dt"] = int(config.get("target_hidden_size") or d["D"])
    for key, name, want in (
        ("D", "hidden_size", target_hidden),
        ("Dt", "target_hidden_size", target_hidden),
        ("V", "vocab_size", target_vocab),
    ):
        if d[key] != want:
            raise ValueError(
                f"EAGLE-3 head {name}={d[key]} does not match the target model's "
                f"{'hidden_size' if key != 'V' else 'vocab_size'}={want}"
            )
    if not 0 < d["Vd"] <= d["V"]:
        raise ValueError(f"EAGLE-3 draft_vocab_size={d['Vd']} must be in 1..vocab_size={d['V']}")
    return d


def aux_layer_ids(config: Mapping, num_layers: int) -> tuple[int, ...]:
    """The three target layers i whose input stream (the residual stream after layer i - 1,
    vLLM's ``hidden_states + residual`` before layer i; i = L: after the last layer, before the
    final norm) ``fc`` takes: config.json's ``eagle_aux_hidden_state_layer_ids`` (top level or
    in ``eagle_config``), else vLLM's default (2, L // 2, L - 3). ValueError: not three ids in
    0..L (the ids and L named)."""
    nested = config.get("eagle_config") or {}
    ids = config.get("eagle_aux_hidden_state_layer_ids") or nested.get(
        "eagle_aux_hidden_state_layer_ids"
    )
    ids = tuple(ids) if ids else (2, num_layers // 2, num_layers - 3)
    if len(ids) != 3 or not all(isinstance(i, int) and 0 <= i <= num_layers for i in ids):
        raise ValueError(
            f"EAGLE-3 aux hidden-state layers {list(ids)} are invalid for a target of "
            f"{num_layers} layers: three layer ids in 0..{num_layers} (set "
            "eagle_aux_hidden_state_layer_ids in the head's config.json)"
        )
    return ids


def check_tensors(shapes: Mapping[str, tuple], d: dict) -> list[str]:
    """Problems of HF tensor ``shapes`` (name -> shape) against `TABLE` under ``d``: each
    missing required tensor, each unexpected one and each wrong shape, named."""
    rules = {r.name: r for r in TABLE}
    bad = [f"unexpected tensor {n!r}" for n in shapes if n not in rules]
    bad += [
        f"missing tensor {r.name!r} {list(r.shape(d))}"
        for r in TABLE
        if r.name not in shapes and r.name not in OPTIONAL and (r.name != "d2t" or d["Vd"] < d["V"])
    ]
    bad += [
        f"tensor {n!r} has shape {list(s)}, expected {list(rules[n].shape(d))}"
        for n, s in shapes.items()
        if n in rules and tuple(s) != tuple(rules[n].shape(d))
    ]
    return bad


def to_leaves(hf: Mapping[str, np.ndarray], d: dict) -> dict:
    """Our leaves from checked HF tensors ``hf``: matrices transposed to [in, out], q|k|v and
    gate|up fused by columns, ``d2t`` i32[Vd] (zeros when absent: Vd = V), ``t2d`` dropped."""
    out, fused = {}, {}
    for r in TABLE:
        if r.name not in hf or not r.leaf:
            continue
        x = hf[r.name]
        if r.leaf == "d2t":
            out["d2t"] = np.asarray(x, np.int64).astype(np.int32)
        elif x.ndim == 1 or r.leaf == "embed":
            out[r.leaf] = x
        elif r.parts > 1:
            fused.setdefault(r.leaf, [None] * r.parts)[r.part] = x.T
        else:
            out[r.leaf] = x.T
    out.update({leaf: np.concatenate(xs, axis=1) for leaf, xs in fused.items()})
    out.setdefault("d2t", np.zeros((d["Vd"],), np.int32))
    return out


def read_eagle3(path: str | os.PathLike, target_hidden: int, target_vocab: int, num_layers: int):
    """The EAGLE-3 head at HF directory ``path`` for a target of width ``target_hidden``,
    vocabulary ``target_vocab`` and ``num_layers`` layers, as an `Eagle3Checkpoint`. Every HF
    tensor is mapped exactly once (`TABLE`). FileNotFoundError: no config.json or weights;
    ValueError: another architecture, sizes other than the target's (`dims`), bad aux layers,
    or tensors missing, unexpected or of a wrong shape (each named)."""
    root = os.fspath(path)
    config = read_json(os.path.join(root, "config.json"))
    if not is_eagle3(config):
        raise ValueError(
            f"{root!r} is not an EAGLE-3 head: config.json architectures="
            f"{config.get('architectures')}, expected [{ARCHITECTURE!r}]"
        )
    d = dims(config, target_hidden, target_vocab)
    aux = aux_layer_ids(config, num_layers)
    hf = dict(iter_tensors(root))
    if bad := check_tensors({n: x.shape for n, x in hf.items()}, d):
        raise ValueError(f"EAGLE-3 head {root!r}: " + "; ".join(bad))
    return Eagle3Checkpoint(config, aux, to_leaves(hf, d))
