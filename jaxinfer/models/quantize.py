"""fp8 (e4m3) weight quantisation of a param tree: the layers' `QUANTIZED` matrices (the weight
table's, `jaxinfer.config.weights`) become float8_e4m3fn plus an f32 ``<name>_scale`` leaf; the rest
kept. Per-channel matrices are stored K-major [out, in] (`weights.kmajor`: cuBLASLt's fp8 GEMM
wants K contiguous in both operands); HF block-scaled ones and MoE expert stacks keep [.., in, out].
Source: Micikevicius et al. 2022, "FP8 Formats for Deep Learning"."""

import functools

import jax
import jax.numpy as jnp

from jaxinfer.config.weights import LAYER, kmajor, scale_shape
from pallas_kernels.kv_quant import FP8, FP8_MAX, quantize  # e4m3, as the fp8 KV pages

FP8_LEAVES = tuple(name for name, leaf in LAYER.items() if leaf.fp8)


def expand_scale(
    scale: jax.Array, shape: tuple[int, int], block: tuple[int, int] | None
) -> jax.Array:
    """A `scale_shape` scale broadcast to the elements of its stored matrix ``shape``: per channel
    f32[..., out, 1] against the K-major [.., out, in] (`weights.kmajor`); block ``(block_out,
    block_in)`` as in `scale_shape`: f32[.., in, out] (a stack's [E, in, out] too)."""
    if block is None:
        return scale[..., :, None]
    rows = jnp.repeat(scale, block[1], axis=-2)[..., : shape[-2], :]
    return jnp.repeat(rows, block[0], axis=-1)[..., : shape[-1]]


@functools.partial(jax.jit, static_argnames=("block", "k_major"))
def quantize_fp8(
    w: jax.Array, block: tuple[int, int] | None = None, k_major: bool = True
) -> tuple[jax.Array, jax.Array]:
    """w [in, out] or a stack [E, in, out] (any float dtype) -> (float8_e4m3fn, f32 scale of
    `scale_shape`): ``scale = amax(|w|) / 448`` over each output channel (``block`` None) or HF
    block ``(block_out, block_in)`` (edge blocks partial; a stack's per expert); all-zero: 1.
    ``q = round_to_nearest_e4m3(w / scale)``, so ``|w - q * scale| <= scale * max(|w / scale| *
    2^-4, 2^-10)``. The matrix comes back K-major [.., out, in] (w's transpose) per channel with
    ``k_major`` (`weights.kmajor`: the dense layers' matrices), else as w ([.., in, out]: blocks
    always, MoE expert stacks)."""
    wf = w.astype(jnp.float32)
    if block is None:
        t = jnp.swapaxes(wf, -1, -2) if k_major else wf
        axis = -1 if k_major else -2  # in
        amax = jnp.max(jnp.abs(t), axis=axis)
        scale = jnp.where(amax > 0, amax / FP8_MAX, 1.0).astype(jnp.float32)
        return quantize(t, jnp.expand_dims(scale, axis), FP8), scale
    (bo, bi), (I, O), (In, Out) = block, scale_shape(w.shape, block)[-2:], w.shape[-2:]
    lead = ((0, 0),) * (w.ndim - 2)
    padded = jnp.pad(jnp.abs(wf), (*lead, (0, I * bi - In), (0, O * bo - Out)))
    amax = padded.reshape(*w.shape[:-2], I, bi, O, bo).max(axis=(-3, -1))
    scale = jnp.where(amax > 0, amax / FP8_MAX, 1.0).astype(jnp.float32)
    return quantize(wf, expand_scale(scale, w.shape, block), FP8), scale


def is_quantized(params: dict) -> bool:
    """Whether ``params`` (a model tree) holds fp8 layer matrices (a ``wqkv_scale`` leaf)."""
    return "wqkv_scale" in params["layers"].get("0", {})


def quantize_params(params: dict, block: tuple[int, int] | None = None) -> dict:
    """A new tree with each layer's fp8 matrices (`config.weights.LAYER`'s ``fp8`` leaves it has:
    `QUANTIZED`, an MoE layer's experts) replaced by `quantize_fp8` of them (``block``:
    ``weight_block_size``; K-major where `weights.kmajor`); other leaves shared. ``params`` is the
    canonical [in, out] tree; a quantised tree is returned as is (it must be in this layout
    already)."""
    if is_quantized(params):
        return params
    layers = {i: dict(layer) for i, layer in params["layers"].items()}
    for layer in layers.values():
        for name in [n for n in FP8_LEAVES if n in layer]:
            layer[name], layer[name + "_scale"] = quantize_fp8(
                layer[name], block, kmajor(name, block)
            )
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
    w [out, in] (K-major, `weights.kmajor`) in one e4m3 x e4m3 GEMM contracting both last axes
    with f32 accumulation, both scales applied to the f32 output: ``(x8 @ w.T) * sx * w_scale``
    with ``w_scale`` f32[out] (per output channel) -> f32 [..., out]. On Hopper this is the shape
    XLA hands to cuBLASLt's fp8 GEMM, which wants both operands K-contiguous: with w [in, out]
    XLA would transpose w on every call."""
    return w8a8_gemm(*quantize_tokens(x), w, w_scale)


def w8a8_gemm(x8: jax.Array, sx: jax.Array, w: jax.Array, w_scale: jax.Array) -> jax.Array:
    """`w8a8_matmul`'s GEMM of activations already quantised per token (`quantize_tokens`, or a
    fused producer: `pallas_kernels.act_quant`): x8 float8_e4m3fn [..., in] with sx f32[..., 1],
    w float8_e4m3fn [out, in] with w_scale f32[out] -> f32 [..., out]."""
    dims = (((x8.ndim - 1,), (1,)), ((), ()))
    y = jax.lax.dot_general(x8, w, dims, preferred_element_type=jnp.float32)
    return y * sx * w_scale
