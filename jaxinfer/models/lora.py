"""LoRA in the forward, many adapters in one step (the device side of `jaxinfer.lora`): the pool
``{module: {"a": [L, S, in, R], "b": [L, S, R, out]}}`` (S = max_loras slots, R = max_lora_rank,
scaling folded into b, zero-padded; `jaxinfer.runner.lora` builds it) and each token's slot as a
one-hot over S (`LoRAStep`); `add_lora` adds the low-rank product of every token's own adapter,
batched over slots (an SGMV-style grouped product as two einsums masked by the one-hot: S is
small). Reference followed: PEFT's ``LoraLayer.forward``, ``y = x W + scaling * (x A^T) B^T``."""

from typing import NamedTuple

import jax
import jax.numpy as jnp

F32 = jnp.float32


class LoRAStep(NamedTuple):
    """A step's adapters: ``pool`` (the module docstring's), ``onehot`` [B, T, S] in the compute
    dtype (row of zeros: the token runs without an adapter)."""

    pool: dict
    onehot: jax.Array


def lora_step(pool: dict | None, slots: jax.Array | None, dtype) -> LoRAStep | None:
    """The `LoRAStep` of token slots ``slots`` i32[B, T] (-1: none) over ``pool``; None when
    either is None (no LoRA: the forward is the plain one)."""
    if pool is None or slots is None:
        return None
    S = next(iter(pool.values()))["a"].shape[1]
    return LoRAStep(pool, (slots[..., None] == jnp.arange(S, dtype=jnp.int32)).astype(dtype))


def add_lora(
    y: jax.Array, x: jax.Array, modules: tuple[str, ...], *, lora: LoRAStep | None, layer
) -> jax.Array:
    """``y`` [B, T, sum of out] (the fused projection of ``modules``' outputs, in order) plus, per
    module, ``(x [B, T, in] @ a[layer, s]) @ b[layer, s]`` for each token's slot s, concatenated
    over ``modules``; f32 accumulation, returned in y.dtype. ``lora`` None: ``y``."""
    if lora is None:
        return y
    with jax.named_scope("lora"):
        parts = []
        for m in modules:
            a, b = lora.pool[m]["a"][layer], lora.pool[m]["b"][layer]  # [S, in, R], [S, R, out]
            xa = jnp.einsum("btd,sdr->btsr", x, a.astype(x.dtype), preferred_element_type=F32)
            xa = (xa * lora.onehot[..., None]).astype(x.dtype)
            parts.append(
                jnp.einsum("btsr,sro->bto", xa, b.astype(x.dtype), preferred_element_type=F32)
            )
        delta = parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=-1)
        return (y + delta).astype(y.dtype)
