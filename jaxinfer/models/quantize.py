"""fp8 (e4m3) weight quantisation of a param tree: the layers' `QUANTIZED` matrices (the weight
table's, `jaxinfer.config.weights`) become float8_e4m3fn plus an f32 ``<name>_scale`` leaf; the rest
kept. Source: Micikevicius et al. 2022, "FP8 Formats for Deep Learning"."""

import functools

import jax
import jax.numpy as jnp

from jaxinfer.config.weights import LAYER, scale_shape
from pallas_kernels.kv_quant import FP8, FP8_MAX, quantize  # e4m3, as the fp8 KV pages

FP8_LEAVES = tuple(name for name, leaf in LAYER.items() if leaf.fp8)


def expand_scale(
    scale: jax.Array, shape: tuple[int, int], block: tuple[int, int] | None
) -> jax.Array:
    """A `scale_shape` scale broadcast to the elements of its matrix: f32[in, out] (per channel:
    f32[..., 1, out], stacks too); block ``(block_out, block_in)`` as in `scale_shape`."""
    if block is None:
        return scale[..., None, :]
    rows = jnp.repeat(scale, block[1], axis=0)[: shape[0]]
    return jnp.repeat(rows, block[0], axis=1)[:, : shape[1]]


@functools.partial(jax.jit, static_argnames="block")
def quantize_fp8(w: jax.Array, block: tuple[int, int] | None = None) -> tuple[jax.Array, jax.Array]:
    """w [in, out] or a stack [E, in, out] (per channel only; any float dtype) -> (float8_e4m3fn
    like w, f32 scale of `scale_shape`): ``scale = amax(|w|) / 448`` over each output channel
    (``block`` None) or HF block ``(block_out, block_in)`` (edge blocks partial); all-zero: 1.
    ``q = round_to_nearest_e4m3(w / scale)``, so ``|w - q * scale| <= scale * max(|w / scale| *
    2^-4, 2^-10)``."""
    wf = w.astype(jnp.float32)
    if block is None:
        amax = jnp.max(jnp.abs(wf), axis=-2)
    else:
        (bo, bi), (I, O), (In, Out) = block, scale_shape(w.shape, block), w.shape
        padded = jnp.pad(jnp.abs(wf), ((0, I * bi - In), (0, O * bo - Out)))
        amax = padded.reshape(I, bi, O, bo).max(axis=(1, 3))
    scale = jnp.where(amax > 0, amax / FP8_MAX, 1.0).astype(jnp.float32)
    return quantize(wf, expand_scale(scale, w.shape, block), FP8), scale


def is_quantized(params: dict) -> bool:
    """Whether ``params`` (a model tree) holds fp8 layer matrices (a ``wqkv_scale`` leaf)."""
    return "wqkv_scale" in params["layers"].get("0", {})


def quantize_params(params: dict, block: tuple[int, int] | None = None) -> dict:
    """A new tree with each layer's fp8 matrices (`config.weights.LAYER`'s ``fp8`` leaves it has:
    `QUANTIZED`, an MoE layer's experts) replaced by `quantize_fp8` of them (``block``:
    ``weight_block_size``); other leaves shared. A quantised tree is returned as is."""
    if is_quantized(params):
        return params
    layers = {i: dict(layer) for i, layer in params["layers"].items()}
    for layer in layers.values():
        for name in [n for n in FP8_LEAVES if n in layer]:
            layer[name], layer[name + "_scale"] = quantize_fp8(layer[name], block)
    return {**params, "layers": layers}


def quantize_tokens(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Dynamic per-token e4m3 quantisation of activations x [..., in] (any float dtype) ->
    (float8_e4m3fn [..., in], f32 scale [..., 1]): ``scale = amax(|x|) / 448`` over each token's
    last axis (all-zero: 1), ``x8 = round_to_nearest_e4m3(x / scale)``. Source: vLLM's
    ``scaled_fp8_quant`` with ``use_per_token_if_dynamic``."""
    xf = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(xf), axis=-1, keepdims=True)
    scale = jnp.where(amax > 0, amax / FP8_MAX, 1.0)
    return quantize(xf, scale, FP8), scale


def w8a8_matmul(x: jax.Array, w: jax.Array, w_scale: jax.Array) -> jax.Array:
    """W8A8: x [..., in] quantised per token (`quantize_tokens`), times the float8_e4m3fn weight
    w [in, out] in one e4m3 x e4m3 GEMM with f32 accumulation, both scales applied to the f32
    output: ``(x8 @ w) * sx * w_scale`` with ``w_scale`` f32[out] (per output channel) -> f32
    [..., out]. On Hopper this is the shape XLA hands to cuBLASLt's fp8 GEMM."""
    x8, sx = quantize_tokens(x)
    y = jnp.matmul(x8, w, preferred_element_type=jnp.float32)
    return y * sx * w_scale
