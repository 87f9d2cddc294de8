"""The LoRA pool on the device (`jaxinfer.models.lora`'s layout): `init_pool` (zeros, S = max_loras
slots of rank R = max_lora_rank for every group of `jaxinfer.lora.peft.GROUPS`, one array per
layer) and `write_slot` (one adapter's arrays into slot s: an in-place update of the donated pool,
the slot a traced index, so loading or swapping an adapter compiles once per engine, never per
adapter or slot)."""

import functools

import jax
import jax.numpy as jnp

from jaxinfer.lora.peft import GROUPS, group_dims, pool_bytes


def init_pool(cfg, max_loras: int, max_rank: int, dtype) -> list:
    """Zeros in ``dtype`` for model config ``cfg``: L layers' {group: {"a": [in, G, S, R], "b":
    [G, S, R, out]}} (`jaxinfer.models.lora`; G modules of `GROUPS`): no slot holds an adapter (a
    zero b adds nothing) and b's blocks off its diagonal stay zero. ValueError naming max_loras,
    max_lora_rank and the pool's bytes (`pool_bytes`): the device cannot hold it."""
    L, S, R = cfg.num_layers, max_loras, max_rank
    shapes = {
        g: dict(a=(i, len(GROUPS[g]), S, R), b=(len(GROUPS[g]), S, R, o))
        for g, (i, o) in group_dims(cfg).items()
    }
    try:  # separate arrays per layer: a layer's step reads them whole (no slice of a stack)
        return [
            {g: {k: jnp.zeros(s, dtype) for k, s in ab.items()} for g, ab in shapes.items()}
            for _ in range(L)
        ]
    except jax.errors.JaxRuntimeError as e:  # RESOURCE_EXHAUSTED
        n = pool_bytes(cfg, S, R, jnp.dtype(dtype).itemsize)
        raise ValueError(
            f"the LoRA pool does not fit in device memory: EngineConfig.max_loras={S} x "
            f"max_lora_rank={R} takes {n:,} B; lower max_loras or max_lora_rank "
            f"({str(e).splitlines()[0][:120]})"
        ) from None


def _set(p: jax.Array, x: jax.Array, start: tuple) -> jax.Array:
    return jax.lax.dynamic_update_slice(p, x.astype(p.dtype), start)


@functools.partial(jax.jit, donate_argnums=(0,))
def _write(pool: list, slot: jax.Array, arrays: dict) -> list:
    """Module j of group g (its columns from ``off``) of every layer: a[:, j, slot] and
    b[j, slot, :, off:off + out] set; the other blocks of b untouched (zeros)."""
    out = []
    for layer, groups in enumerate(pool):
        new = {}
        for g, p in groups.items():
            a, b, off = p["a"], p["b"], 0
            for j, m in enumerate(GROUPS[g]):
                x, y = arrays[m]["a"][layer], arrays[m]["b"][layer]  # [in, R], [R, out]
                a = _set(a, x[:, None, None], (0, j, slot, 0))
                b = _set(b, y[None, None], (j, slot, 0, off))
                off += y.shape[-1]
            new[g] = dict(a=a, b=b)
        out.append(new)
    return out


def _slot_shapes(pool: list, arrays: dict) -> tuple[dict, dict]:
    """(the shapes ``pool`` takes for one slot, those of ``arrays``): {module: {"a": (L, in, R),
    "b": (L, R, out)}}; a module's out read from ``arrays`` when its group's outs sum to b's."""
    L, want = len(pool), {}
    got = jax.tree.map(lambda a: tuple(a.shape), arrays)
    for g, p in pool[0].items():
        (i, _, _, R), out = p["a"].shape, p["b"].shape[-1]
        outs = [got.get(m, {}).get("b", (0, 0, 0))[-1] for m in GROUPS[g]]
        outs = outs if sum(outs) == out and all(outs) else ["?"] * len(outs)
        want |= {m: dict(a=(L, i, R), b=(L, R, o)) for m, o in zip(GROUPS[g], outs)}
    return want, got


def write_slot(pool: list, slot: int, arrays: dict) -> list:
    """``pool`` (donated: its buffers are reused) with slot ``slot`` set to ``arrays``
    ({module: {"a": [L, in, R], "b": [L, R, out]}}, `jaxinfer.lora.peft.slot_arrays`'s; numpy
    or JAX). ValueError: a slot outside [0, S), arrays of other structure or shapes."""
    S = next(iter(pool[0].values()))["a"].shape[2]
    if not 0 <= slot < S:
        raise ValueError(f"LoRA slot {slot} is invalid: the pool has slots [0, {S})")
    want, got = _slot_shapes(pool, arrays)
    if jax.tree.structure(want) != jax.tree.structure(got) or want != got:
        raise ValueError(f"LoRA slot arrays have shapes {got}; the pool needs {want}")
    return _write(pool, jnp.asarray(slot, jnp.int32), arrays)
