"""The LoRA pool on the device (`jaxinfer.models.lora`'s layout): `init_pool` (zeros, S = max_loras
slots of rank R = max_lora_rank for every module of `jaxinfer.lora.peft.MODULES`) and `write_slot`
(one adapter's arrays into slot s: an in-place update of the donated pool, the slot a traced
index, so loading or swapping an adapter compiles once per engine, never per adapter or slot)."""

import functools

import jax
import jax.numpy as jnp

from jaxinfer.lora.peft import module_dims, pool_bytes


def init_pool(cfg, max_loras: int, max_rank: int, dtype) -> dict:
    """Zeros {module: {"a": [L, S, in, R], "b": [L, S, R, out]}} in ``dtype`` for model config
    ``cfg``: no slot holds an adapter (a zero b adds nothing). ValueError naming max_loras,
    max_lora_rank and the pool's bytes (`pool_bytes`): the device cannot hold it."""
    L, S, R = cfg.num_layers, max_loras, max_rank
    try:
        return {
            m: dict(a=jnp.zeros((L, S, i, R), dtype), b=jnp.zeros((L, S, R, o), dtype))
            for m, (i, o) in module_dims(cfg).items()
        }
    except jax.errors.JaxRuntimeError as e:  # RESOURCE_EXHAUSTED
        n = pool_bytes(cfg, S, R, jnp.dtype(dtype).itemsize)
        raise ValueError(
            f"the LoRA pool does not fit in device memory: EngineConfig.max_loras={S} x "
            f"max_lora_rank={R} takes {n:,} B; lower max_loras or max_lora_rank "
            f"({str(e).splitlines()[0][:120]})"
        ) from None


@functools.partial(jax.jit, donate_argnums=(0,))
def _write(pool: dict, slot: jax.Array, arrays: dict) -> dict:
    return jax.tree.map(lambda p, a: p.at[:, slot].set(a.astype(p.dtype)), pool, arrays)


def write_slot(pool: dict, slot: int, arrays: dict) -> dict:
    """``pool`` (donated: its buffers are reused) with slot ``slot`` set to ``arrays``
    ({module: {"a": [L, in, R], "b": [L, R, out]}}, `jaxinfer.lora.peft.slot_arrays`'s; numpy
    or JAX). ValueError: a slot outside [0, S), arrays of other structure or shapes."""
    S = next(iter(pool.values()))["a"].shape[1]
    if not 0 <= slot < S:
        raise ValueError(f"LoRA slot {slot} is invalid: the pool has slots [0, {S})")
    want = jax.tree.map(lambda p: p.shape[:1] + p.shape[2:], pool)
    got = jax.tree.map(lambda a: tuple(a.shape), arrays)
    if jax.tree.structure(want) != jax.tree.structure(got) or want != got:
        raise ValueError(f"LoRA slot arrays have shapes {got}; the pool needs {want}")
    return _write(pool, jnp.asarray(slot, jnp.int32), arrays)
