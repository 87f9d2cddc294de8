"""The models as pure functions of (params, inputs, KV state), by ``cfg.architecture``; ``params``:
the tree the Flax modules declare (`jaxinfer.models.llama`), shapes from `abstract_params`."""

import dataclasses
import functools

import jax
import jax.numpy as jnp

from checkpoints_tools.mapping import tree_mismatches
from jaxinfer.config.weights import fused_parts
from jaxinfer.models.kernels import ModelKernels
from jaxinfer.models.kv_cache import KVCache
from jaxinfer.models.layers import Ragged
from jaxinfer.models.llama import LlamaForCausalLM
from jaxinfer.models.lora import lora_step
from jaxinfer.models.quantize import is_quantized, quantize_params

__all__ = [
    "Ragged",
    "fused_parts",
    "forward",
    "compute_logits",
    "init_params",
    "abstract_params",
    "check_params",
    "QUANTIZATIONS",
]
QUANTIZATIONS = (None, "fp8")


def _model(cfg, kernels: ModelKernels, dtype, quantization: str | None = None):
    """Llama's modules serve every architecture `ModelConfig` accepts (llama, qwen3, qwen3_moe).
    ValueError: a ``quantization`` not allowed."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization={quantization!r} is invalid: allowed {QUANTIZATIONS}")
    return LlamaForCausalLM(cfg, kernels, jnp.dtype(dtype), quantization)


def forward(
    params: dict,
    cfg,
    tokens: jax.Array,
    positions: jax.Array,
    slot_mapping: jax.Array,
    kv: KVCache,
    *,
    kernels: ModelKernels = ModelKernels(),
    ragged: Ragged | None = None,
    lora_slots: jax.Array | None = None,
) -> tuple[jax.Array, KVCache]:
    """One step over the paged cache: tokens, positions, slot_mapping i32[B, T]; ``kv``:
    block_tables i32[R, M], seq_lens i32[R] after this write (R = B unless ``ragged``: tokens [1,
    T] in R ragged rows) -> (hidden [B, T, D], new cache). ``params["lora"]``, if present: the
    LoRA pool (`models.lora`), each token's adapter its slot in ``lora_slots`` i32[B, T] (-1:
    none; None: no adapter for any token)."""
    params = dict(params)
    lora = lora_step(params.pop("lora", None), lora_slots, params["embed"].dtype)
    model = _model(cfg, kernels, params["embed"].dtype, "fp8" if is_quantized(params) else None)
    return model.apply({"params": params}, tokens, positions, slot_mapping, kv, ragged, lora)


def compute_logits(params: dict, cfg, hidden: jax.Array) -> jax.Array:
    """f32[..., V] = hidden [..., D] @ (lm_head, or embed.T tied); ValueError: untied, no head."""
    if cfg.tie_word_embeddings:
        w, spec = params["embed"], "...d,vd->...v"
    elif "lm_head" in params:
        w, spec = params["lm_head"], "...d,dv->...v"
    else:
        raise ValueError(
            "params has no 'lm_head' but cfg.tie_word_embeddings=False; "
            "an untied model needs lm_head [D, V]"
        )
    return jnp.einsum(spec, hidden.astype(w.dtype), w, preferred_element_type=jnp.float32)


def _init_fn(cfg, dtype, quantization: str | None = None):
    """``key -> params``, the modules' init (fp8: draws cast to e4m3, scales 1; `init_params`)."""
    model = _model(cfg, ModelKernels(), dtype, quantization)

    def init(key):
        pool = jnp.zeros((cfg.num_layers, 2, cfg.num_kv_heads, 1, cfg.head_dim), dtype)
        one = jnp.ones((1, 1), jnp.int32)
        kv = KVCache(pool, pool, one, jnp.ones((1,), jnp.int32))
        return model.init(key, one * 0, one * 0, one, kv)["params"]

    return init


def init_params(cfg, key: jax.Array, dtype, quantization: str | None = None) -> dict:
    """Random params in ``dtype``: matrices and embedding ~ N(0, 0.02), norms 1; "fp8": then
    `jaxinfer.models.quantize.quantize_params`. ValueError: another ``quantization``."""
    params = jax.jit(_init_fn(cfg, dtype))(key)
    if quantization is None:
        return params
    _model(cfg, ModelKernels(), dtype, quantization)  # checks the value
    return quantize_params(params, cfg.weight_block_size)


def abstract_params(cfg, dtype=jnp.bfloat16, quantization: str | None = None) -> dict:
    """ShapeDtypeStruct tree of the params as the modules declare them (``jax.eval_shape`` of
    their init; ``quantization`` None or "fp8"), a new tree each call. Unquantised, every leaf
    is in ``dtype`` and a tied config's tree is the untied one less ``lm_head``: one trace per
    untied config serves every dtype and both tyings (a load and `check_params` ask for the
    same tree; a trace costs 0.4 s for SmolLM2). ValueError: another ``quantization``."""
    if quantization is not None or not dataclasses.is_dataclass(cfg):
        return jax.eval_shape(_init_fn(cfg, dtype, quantization), jax.random.key(0))
    untied = dataclasses.replace(cfg, tie_word_embeddings=False)
    try:
        tree = _untied_f32(untied)
    except TypeError:  # an unhashable cfg (e.g. a dict field)
        tree = _untied_f32.__wrapped__(untied)
    if cfg.tie_word_embeddings:
        tree = {k: v for k, v in tree.items() if k != "lm_head"}
    return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, jnp.dtype(dtype)), tree)


@functools.lru_cache(maxsize=8)
def _untied_f32(cfg) -> dict:
    return jax.eval_shape(_init_fn(cfg, jnp.float32), jax.random.key(0))


def check_params(params: dict, cfg, quantization: str | None = None) -> None:
    """``params`` vs `abstract_params` (``quantization``); ValueError listing each missing or
    unexpected entry and bad shape (`checkpoints_tools.mapping.tree_mismatches`)."""
    if bad := tree_mismatches(abstract_params(cfg, quantization=quantization), params, slash=True):
        raise ValueError(
            "params have missing or unexpected entries or wrong shapes for the model "
            f"(tie_word_embeddings={cfg.tie_word_embeddings}, quantization="
            f"{quantization!r}): " + "; ".join(bad)
        )
