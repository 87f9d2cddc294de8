"""LoRA in the forward, many adapters in one step (the device side of `jaxinfer.lora`): the pool,
one dict per layer ``{group: {"a": [in, G, S, R], "b": [G, S, R, out]}}`` (a group: the G modules
of one fused projection that read the same x, named after its weight, `jaxinfer.lora.peft.GROUPS`:
"wqkv" q|k|v, "wo", "w_gate_up" gate|up, "w_down"; S = max_loras slots, R = max_lora_rank, scaling
folded into b, zero-padded; b block diagonal: module j's [R, out_j] at rows (j, s), columns of its
slice of the fused output, zeros elsewhere; `jaxinfer.runner.lora` builds and writes it) and a
token mask [B, T, S*R] (1 at s*R + r where the token's slot is s). `add_lora` adds a group's
low-rank products for every token's own adapter as two plain GEMMs, batched over slots and modules
(SGMV-style, masked: S*R is small): ``(x [BT, in] @ a [in, G*S*R]) * mask`` then ``@ b [G*S*R,
out]``, whose output is already the fused projection's layout, so the add needs no concatenate.
Per layer and group: two dots and two elementwise ops, whatever G.
b's zero blocks cost bytes, not launches: (G - 1) * S * R * out elements a layer (Qwen3-8B, S*R =
64: 4.7 MB of the layer's 390 MB of weights, about 1.4 us at 3.35 TB/s, where the G - 1 dots it
saves take a launch each, a few us at B=1; at B=64 the extra FLOPs are as negligible). Reference
followed: PEFT's ``LoraLayer.forward``, ``y = x W + scaling * (x A^T) B^T``."""

from typing import NamedTuple

import jax
import jax.numpy as jnp

F32 = jnp.float32


class LoRAStep(NamedTuple):
    """A step's adapters: ``pool`` (the module docstring's: the L layers' list from `lora_step`,
    one layer's dict from `at_layer`), ``mask`` [B, T, S*R] in the compute dtype (row of zeros:
    the token runs without an adapter)."""

    pool: list | dict
    mask: jax.Array


def lora_step(pool: list | None, slots: jax.Array | None, dtype) -> LoRAStep | None:
    """The `LoRAStep` of token slots ``slots`` i32[B, T] (-1: none) over ``pool`` (L layers'
    dicts), its mask built once for every layer; None when either is None (no LoRA: the forward
    is the plain one)."""
    if pool is None or slots is None:
        return None
    S, R = next(iter(pool[0].values()))["a"].shape[2:]
    cols = jnp.arange(S * R, dtype=jnp.int32) // R  # column s*R + r -> its slot s
    return LoRAStep(pool, (slots[..., None] == cols).astype(dtype))


def at_layer(lora: LoRAStep | None, layer: int) -> LoRAStep | None:
    """``lora`` with layer ``layer``'s pool dict (its own arrays: no slice of a stacked pool in
    the step); None: None."""
    return None if lora is None else lora._replace(pool=lora.pool[layer])


def add_lora(y: jax.Array, x: jax.Array, group: str, *, lora: LoRAStep | None) -> jax.Array:
    """``y`` [B, T, out] (the fused projection ``group`` of the layer's pool, its modules'
    outputs in order) plus, per module j, ``(x [B, T, in] @ a[:, j, s]) @ b[j, s]`` for each
    token's slot s (`at_layer`'s pool); f32 accumulation, the masked x @ a rounded to x.dtype,
    returned in y.dtype. ``lora`` None: ``y``."""
    if lora is None:
        return y
    with jax.named_scope("lora"):
        a, b = lora.pool[group]["a"], lora.pool[group]["b"]  # [in, G, S, R], [G, S, R, out]
        n, G = a.shape[0], a.shape[1]
        SR = lora.mask.shape[-1]
        a = a.reshape(n, G * SR).astype(x.dtype)  # row-major: a bitcast, no copy
        xa = jnp.matmul(x, a, preferred_element_type=F32)  # [B, T, G*S*R]
        xa = xa.reshape(*x.shape[:-1], G, SR) * lora.mask[..., None, :]
        xa = xa.reshape(*x.shape[:-1], G * SR).astype(x.dtype)
        b = b.reshape(G * SR, b.shape[-1]).astype(x.dtype)
        return (y + jnp.matmul(xa, b, preferred_element_type=F32)).astype(y.dtype)
