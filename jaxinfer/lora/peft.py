"""PEFT LoRA adapters as numpy (no JAX): the modules LoRA may target (`MODULES`, their [in, out]
sizes from a model config: `module_dims`; the fused projections they add to: `GROUPS`,
`group_dims`; the device pool's bytes: `pool_bytes`), a PEFT
directory checked (`check_adapter`) and read (`load_adapter`: its
``adapter_config.json`` and ``adapter_model.safetensors``), a tensor dict mapped onto the layers
(`parse_tensors`, also what `LLM.update_lora` takes) and an adapter laid out as one slot of the
device pool (`slot_arrays`). Reference followed: PEFT's ``LoraLayer`` (``y = x W + scaling *
(x A^T) B^T``, ``scaling = lora_alpha / r``, ``lora_alpha / sqrt(r)`` with ``use_rslora``) and
vLLM's ``PEFTHelper`` checks."""

import dataclasses
import json
import math
import os
import re

import numpy as np

MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight (PEFT's saved name), the adapter
# name ("lora_A.default.weight") allowed, as get_peft_model_state_dict / state_dict give them
_NAME = re.compile(
    r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.\w+)?\.weight$"
)
_UNSUPPORTED = {  # adapter_config.json key: (its allowed values, what they mean)
    "bias": ((None, "none"), "'none' (no bias terms)"),
    "use_dora": ((None, False), "False (DoRA is not supported)"),
    "modules_to_save": ((None, []), "None (no full-weight modules)"),
    "rank_pattern": ((None, {}), "{} (one rank for every module)"),
    "alpha_pattern": ((None, {}), "{} (one lora_alpha for every module)"),
    "layers_to_transform": ((None,), "None (the adapter's layers are its weights' layers)"),
    "layers_pattern": ((None,), "None (the adapter's layers are its weights' layers)"),
}


# the pool's entries: the fused base weight (`jaxinfer.config.weights`) each one adds to -> its
# modules, in the weight's column order (one device: LoRA runs without tensor parallelism)
GROUPS = {
    "wqkv": ("q_proj", "k_proj", "v_proj"),
    "wo": ("o_proj",),
    "w_gate_up": ("gate_proj", "up_proj"),
    "w_down": ("down_proj",),
}


def module_dims(cfg) -> dict[str, tuple[int, int]]:
    """Each of `MODULES` -> its (in, out) for model config ``cfg``: q D -> N*H, k and v D -> K*H,
    o N*H -> D, gate and up D -> F, down F -> D."""
    D, F, H = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q, kv = cfg.num_heads * H, cfg.num_kv_heads * H
    return dict(
        q_proj=(D, q),
        k_proj=(D, kv),
        v_proj=(D, kv),
        o_proj=(q, D),
        gate_proj=(D, F),
        up_proj=(D, F),
        down_proj=(F, D),
    )


def model_shape(cfg) -> dict[str, int]:
    """The fields of model config ``cfg`` that `module_dims` and `parse_tensors` read (sizes and
    the layer count), as a plain dict: what the engine core hands the API process so that it
    checks an adapter's weights (`load_adapter` on ``types.SimpleNamespace(**shape)``)."""
    keys = ("hidden_size", "intermediate_size", "head_dim", "num_heads", "num_kv_heads")
    return {k: int(getattr(cfg, k)) for k in (*keys, "num_layers")}


def group_dims(cfg) -> dict[str, tuple[int, int]]:
    """Each of `GROUPS` -> (in, out) for model config ``cfg``: its modules' shared in and the sum
    of their outs (the fused weight's [in, out])."""
    dims = module_dims(cfg)
    return {g: (dims[ms[0]][0], sum(dims[m][1] for m in ms)) for g, ms in GROUPS.items()}


def pool_bytes(cfg, max_loras: int, max_rank: int, dtype_bytes: int) -> int:
    """Bytes of the device pool of ``max_loras`` S slots of rank ``max_rank`` R for model config
    ``cfg`` (`jaxinfer.runner.lora.init_pool`: per layer and group of G modules of `GROUPS`, a
    [in, G, S, R] and b [G, S, R, out], b block diagonal with out the modules' summed outs),
    ``dtype_bytes`` an element: dtype_bytes * L * S * R * sum over groups of G * (in + out)."""
    per_rank = sum(len(GROUPS[g]) * (i + o) for g, (i, o) in group_dims(cfg).items())
    return dtype_bytes * cfg.num_layers * max_loras * max_rank * per_rank


@dataclasses.dataclass(frozen=True)
class PeftAdapter:
    """A LoRA adapter of rank ``rank`` r, ``scaling`` applied to the product, ``weights``: module
    -> (a f32[L, in, r], b f32[L, r, out]) (A and B transposed to ``[in, out]`` like the base
    weights; a layer without the module's tensors: zeros)."""

    rank: int
    scaling: float
    weights: dict


class AdapterError(ValueError):
    """A LoRA adapter that cannot be served (its files, its tensors, its id): a ValueError of
    its own kind, so that a server can name the request field that chose the adapter. Raised
    for one adapter (`_fail`): ``adapter`` (its path, or its name where no path applies) and
    ``reason`` set, the message one line ``LoRA adapter {adapter!r}: {reason}``; else None."""

    def __init__(self, message: str, adapter: str | None = None, reason: str | None = None):
        super().__init__(message)
        self.adapter, self.reason = adapter, reason

    def named(self, name: str) -> "AdapterError":
        """This error naming the adapter ``name`` (`LoRARequest.lora_name`, a server's
        ``--lora-modules`` name) before its path: ``LoRA adapter 'sql' ('/path/x'): {reason}``,
        this one's traceback kept; itself where it names no adapter (``reason`` None) or
        ``name`` already."""
        if self.reason is None or name == self.adapter:
            return self
        message = f"LoRA adapter {name!r} ({self.adapter!r}): {self.reason}"
        return AdapterError(message, self.adapter, self.reason).with_traceback(self.__traceback__)


def _fail(path: str, what: str) -> None:
    raise AdapterError(f"LoRA adapter {path!r}: {what}", path, what)


def read_config(path: str, max_rank: int) -> tuple[int, float]:
    """(r, scaling) of ``path``/adapter_config.json: `read_config_targets` without the targets."""
    return read_config_targets(path, max_rank)[:2]


def read_config_targets(path: str, max_rank: int) -> tuple[int, float, set[str]]:
    """(r, scaling, the target modules' names) of ``path``/adapter_config.json. ValueError naming
    ``path`` and the value: no such file, not a JSON object, no LoRA config, r not in [1,
    ``max_rank``] (EngineConfig.max_lora_rank), target_modules not as `_targets` allows, a
    feature not supported (`_UNSUPPORTED`: layers_to_transform, DoRA, ...)."""
    file = os.path.join(path, "adapter_config.json")
    if not os.path.isfile(file):
        _fail(path, "no adapter_config.json (a PEFT LoRA directory is needed)")
    try:
        with open(file, encoding="utf-8") as f:
            c = json.load(f)
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
        _fail(path, f"adapter_config.json is not valid JSON ({e})")
    except OSError as e:  # a permission, a directory so named
        _fail(path, f"adapter_config.json cannot be read ({e})")
    if not isinstance(c, dict):
        _fail(path, f"adapter_config.json holds a {type(c).__name__}; a JSON object is needed")
    if c.get("peft_type", "LORA") != "LORA":
        _fail(path, f"peft_type={c['peft_type']!r} is not supported; allowed: 'LORA'")
    r, alpha = c.get("r"), c.get("lora_alpha", c.get("r"))
    if isinstance(r, bool) or not isinstance(r, int) or not 1 <= r <= max_rank:
        _fail(path, f"r={r!r} is invalid: must be an integer in [1, max_lora_rank={max_rank}]")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
        _fail(path, f"lora_alpha={alpha!r} is invalid: must be a number")
    targets = _targets(c.get("target_modules"), path)
    for key, (ok, allowed) in _UNSUPPORTED.items():
        if c.get(key) not in ok:
            _fail(path, f"{key}={c[key]!r} is not supported; allowed: {allowed}")
    return r, alpha / (math.sqrt(r) if c.get("use_rslora") else r), targets


def _targets(targets, path: str) -> set[str]:
    """The module names of adapter_config.json's ``target_modules``: a non-empty list of names of
    `MODULES` (full paths, as "all-linear" saves them, read as their last name). ValueError
    naming the value: a str (PEFT's regex), not a list of str, empty, a module not in
    `MODULES`."""
    allowed = f"a non-empty list of module names of {list(MODULES)}"
    if isinstance(targets, str):
        _fail(
            path, f"target_modules={targets!r} is a regex string: not supported; allowed: {allowed}"
        )
    if not isinstance(targets, list) or not all(isinstance(t, str) for t in targets):
        _fail(path, f"target_modules={targets!r} is invalid: must be {allowed}")
    if not targets:
        _fail(path, f"target_modules=[] names no module; allowed: {allowed}")
    names = {t.rsplit(".", 1)[-1] for t in targets}
    if bad := sorted(names - set(MODULES)):
        _fail(path, f"target_modules {bad} are not supported; allowed: {list(MODULES)}")
    return names


def parse_tensors(tensors: dict, cfg, rank: int, where: str) -> dict:
    """PEFT-named tensors (``...layers.{i}.{self_attn|mlp}.{module}.lora_{A|B}.weight``: A [r, in],
    B [out, r]; numpy, torch or JAX arrays) -> module -> (a f32[L, in, r], b f32[L, r, out]).
    ValueError naming the tensor (``where``: the adapter, for the message): an unknown name or
    module, a layer >= L, a shape not the model's, a NaN or Inf, an A without its B."""
    L, dims, out, seen = cfg.num_layers, module_dims(cfg), {}, set()
    for name, t in tensors.items():
        m = _NAME.search(name)
        if m is None or m[2] not in dims:
            _fail(where, f"tensor {name!r} is not a LoRA weight of {list(MODULES)}")
        layer, module, ab = int(m[1]), m[2], m[3]
        if layer >= L:
            _fail(where, f"tensor {name!r}: layer {layer} >= the model's {L} layers")
        t = np.asarray(t.float() if hasattr(t, "float") else t, np.float32)
        i, o = dims[module]
        want = (rank, i) if ab == "A" else (o, rank)
        if t.shape != want:
            _fail(where, f"tensor {name!r} has shape {list(t.shape)}; expected {list(want)}")
        if not np.isfinite(t).all():  # a slot's NaN would reach every row (masked products)
            _fail(where, f"tensor {name!r} has non-finite values (NaN or Inf)")
        if module not in out:
            out[module] = (np.zeros((L, i, rank), np.float32), np.zeros((L, rank, o), np.float32))
        out[module][ab == "B"][layer] = t.T
        seen.add((layer, module, ab))
    if bad := sorted(
        (lay, mod) for lay, mod, ab in seen if (lay, mod, "BA"[ab == "B"]) not in seen
    ):
        _fail(where, f"(layer, module) {bad[:4]} have lora_A or lora_B but not both")
    return out


def check_adapter(path: str, max_rank: int) -> tuple[int, float]:
    """(r, scaling) of the PEFT LoRA directory ``path`` once its config passes, without reading
    the weights (`load_adapter` reads and checks them). ValueError: as `_check_files`."""
    return _check_files(path, max_rank)[:2]


def _check_files(path: str, max_rank: int) -> tuple[int, float, set[str]]:
    """`read_config_targets` of the directory ``path``. ValueError: not a directory, as
    `read_config_targets`, no ``adapter_model.safetensors``."""
    if not os.path.isdir(path):
        _fail(path, "no such directory")
    config = read_config_targets(path, max_rank)
    if not os.path.isfile(os.path.join(path, "adapter_model.safetensors")):
        _fail(path, "no adapter_model.safetensors")
    return config


def load_adapter(path: str, cfg, max_rank: int) -> PeftAdapter:
    """The PEFT LoRA directory ``path`` for model config ``cfg`` (on the host, numpy): its config
    (`_check_files`) then ``adapter_model.safetensors`` through `parse_tensors`. ValueError: as
    `_check_files` and `parse_tensors`; an unreadable weights file; a module of the weights not
    in the config's target_modules (`AdapterError`s naming ``path``)."""
    from safetensors.numpy import load_file

    rank, scaling, targets = _check_files(path, max_rank)
    file = os.path.join(path, "adapter_model.safetensors")
    try:
        tensors = load_file(file)
    except Exception as e:  # noqa: BLE001 (safetensors' own error types: a corrupt file)
        _fail(path, f"adapter_model.safetensors cannot be read ({type(e).__name__}: {e})")
    weights = parse_tensors(tensors, cfg, rank, path)
    if extra := sorted(set(weights) - targets):
        _fail(
            path,
            f"adapter_model.safetensors holds modules {extra} that adapter_config.json's "
            f"target_modules {sorted(targets)} does not name; allowed: the target_modules only",
        )
    return PeftAdapter(rank, scaling, weights)


def slot_arrays(adapter: PeftAdapter, cfg, max_rank: int, dtype) -> dict:
    """``adapter`` as one slot of the pool: {module: {"a": [L, in, R], "b": [L, R, out]}} for
    every one of `MODULES`, R = ``max_rank`` (zero-padded), ``scaling`` folded into b, zeros
    for modules it does not target; numpy in ``dtype``."""
    L, r, out = cfg.num_layers, adapter.rank, {}
    for module, (i, o) in module_dims(cfg).items():
        a, b = np.zeros((L, i, max_rank), np.float32), np.zeros((L, max_rank, o), np.float32)
        if module in adapter.weights:
            a[..., :r], b[:, :r] = adapter.weights[module][0], adapter.weights[module][1]
            b *= adapter.scaling
        out[module] = dict(a=a.astype(dtype), b=b.astype(dtype))
    return out
