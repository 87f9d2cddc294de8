"""Paged KV cache, a pytree threaded through the jitted step (donated). Page 0
(`jaxinfer.engine.block_manager.NULL_PAGE`) is no sequence's: padding writes into it."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxinfer.config import ModelConfig


@dataclass(frozen=True)
class KVCache:
    """k, v [L, P, K, page_size, H] (compute dtype); block_tables i32[B, M] (logical page j of
    row b -> physical page); seq_lens i32[B] (valid KV positions after the write)."""

    k: jax.Array
    v: jax.Array
    block_tables: jax.Array
    seq_lens: jax.Array

    @property
    def num_pages(self) -> int:
        return self.k.shape[1]

    def replace(self, **kw) -> "KVCache":
        return dataclasses.replace(self, **kw)


jax.tree_util.register_dataclass(
    KVCache, data_fields=["k", "v", "block_tables", "seq_lens"], meta_fields=[])


def init_kv_cache(cfg: ModelConfig, num_pages: int, page_size: int, dtype,
                  sharding=None) -> KVCache:
    """Zeroed pools [L, P, K, page_size, H] placed with ``sharding`` (None: the default device),
    one padded table row (with a ``NamedSharding``: replicated on its mesh); ValueError:
    num_pages < 2."""
    if num_pages < 2:
        raise ValueError(f"num_pages={num_pages} is too small: need >= 2 (page 0 is reserved)")
    shape = (cfg.num_layers, num_pages, cfg.num_kv_heads, page_size, cfg.head_dim)
    zeros = jax.jit(lambda: jnp.zeros(shape, jnp.dtype(dtype)), out_shardings=sharding)
    tables = NamedSharding(sharding.mesh, P()) if isinstance(sharding, NamedSharding) else None
    return KVCache(k=zeros(), v=zeros(),
                   block_tables=jax.device_put(np.zeros((1, 1), np.int32), tables),
                   seq_lens=jax.device_put(np.zeros((1,), np.int32), tables))


def write_kv(k_pool: jax.Array, v_pool: jax.Array, layer, k_new: jax.Array, v_new: jax.Array,
             slot_mapping: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Scatter k_new, v_new [B, T, K, H] into layer ``layer`` (int or i32[]) of the pools at
    ``slot_mapping`` i32[B, T] (``page * page_size + offset``); returns the new pools."""
    page, off = jnp.divmod(slot_mapping.reshape(-1), k_pool.shape[3])  # shape[3]: page_size
    kn = k_new.reshape(-1, *k_new.shape[2:]).astype(k_pool.dtype)  # [B*T, K, H]
    vn = v_new.reshape(-1, *v_new.shape[2:]).astype(v_pool.dtype)
    k_pool = k_pool.at[layer, page, :, off, :].set(kn, mode="promise_in_bounds")
    v_pool = v_pool.at[layer, page, :, off, :].set(vn, mode="promise_in_bounds")
    return k_pool, v_pool
