"""Paged KV cache, a pytree through the jitted step (donated); padding writes to `NULL_PAGE`."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxinfer.config import ModelConfig
from pallas_kernels.kv_quant import FP8, check_scales, is_fp8

STORED = {jnp.dtype(jnp.bfloat16): jnp.dtype(jnp.uint16), FP8: jnp.dtype(jnp.uint8)}
PAGES = {v: k for k, v in STORED.items()}
AXIS = "tp"  # the mesh axis of tensor parallelism (`jaxinfer.runner.parallel`)
KV_POOL_SPEC = P(None, None, AXIS, None, None)  # pools [L, P, K', page_size, H]: split over K'
KV_HEAD_SPEC = P(None, AXIS)  # scales f32[L, K'], means f32[L, K', H]: split over K' as the pools


@jax.tree_util.register_dataclass  # every field a pytree child
@dataclasses.dataclass(frozen=True)
class KVCache:
    """k, v [L, P, K, page_size, H] (compute dtype, or float8_e4m3fn; kept in `stored_dtype`
    of it); block_tables i32[B, M]
    (logical page j of row b -> physical page); seq_lens i32[B] (valid KV positions after the
    write); k_scale, v_scale f32[L, K] (None: no scaling): an fp8 page holds ``(x - mean) /
    scale`` (`kv_quant`); 1.0 from `init_kv_cache` (vLLM's default); k_mean, v_mean f32[L, K, H]
    (None: 0, as from `init_kv_cache`): SageAttention's smoothing (arXiv 2410.02367), exact as
    softmax(q.(k - m)) = softmax(q.k) and `layers.attention_heads` adds V's mean back. Under
    tensor parallelism K is the engine's K' and the scales and means are split over it as the
    pools are (`KV_HEAD_SPEC`), so each device reads its own heads'."""

    k: jax.Array
    v: jax.Array
    block_tables: jax.Array
    seq_lens: jax.Array
    k_scale: jax.Array | None = None
    v_scale: jax.Array | None = None
    k_mean: jax.Array | None = None
    v_mean: jax.Array | None = None

    def replace(self, **kw) -> "KVCache":
        return dataclasses.replace(self, **kw)

    def scales(self) -> tuple:
        """(k_scale, v_scale, k_mean, v_mean) if the pools are fp8, else 4 Nones; ValueError."""
        if not is_fp8(page_dtype(self.k.dtype)):
            return (None,) * 4
        check_scales(self.k, self.k_scale, self.v_scale)
        return self.k_scale, self.v_scale, self.k_mean, self.v_mean


def stored_dtype(dtype, platform: str) -> jnp.dtype:
    """The dtype a pool of ``dtype`` pages is kept in: on "cpu" bf16 and fp8 as the unsigned integer
    of their width (XLA:CPU copies a whole bf16 or fp8 pool at each scatter, not these), else
    ``dtype``. `page_dtype` inverts it; ``pool.view(page_dtype(pool.dtype))`` reads the pages."""
    return STORED.get(jnp.dtype(dtype), jnp.dtype(dtype)) if platform == "cpu" else jnp.dtype(dtype)


def page_dtype(dtype) -> jnp.dtype:
    """The pages' dtype of a pool kept in ``dtype`` (`stored_dtype`)."""
    return PAGES.get(jnp.dtype(dtype), jnp.dtype(dtype))


def put_heads(x, mesh=None) -> jax.Array:
    """``x`` (scales [L, K], means [L, K, H]) as f32 on ``mesh``, split over K by `KV_HEAD_SPEC`;
    None: on the default device."""
    return jax.device_put(
        np.asarray(x, np.float32), None if mesh is None else NamedSharding(mesh, KV_HEAD_SPEC)
    )


def init_kv_cache(
    cfg: ModelConfig, num_pages: int, page_size: int, dtype, sharding=None, means=None
) -> KVCache:
    """Zeroed pools [L, P, K, page_size, H] of ``dtype`` placed with ``sharding``, scales 1.0 and
    ``means`` ((k_mean, v_mean) f32[L, K, H], or None: none) placed by `put_heads`, one padded
    table row (replicated), on a ``NamedSharding``'s mesh; ValueError: num_pages < 2."""
    if num_pages < 2:
        raise ValueError(f"num_pages={num_pages} is too small: need >= 2 (page 0 is reserved)")
    shape = (cfg.num_layers, num_pages, cfg.num_kv_heads, page_size, cfg.head_dim)
    zeros = jax.jit(lambda: jnp.zeros(shape, jnp.dtype(dtype)), out_shardings=sharding)
    mesh = sharding.mesh if isinstance(sharding, NamedSharding) else None
    tables = None if mesh is None else NamedSharding(mesh, P())
    ones = np.ones((cfg.num_layers, cfg.num_kv_heads))
    k_mean, v_mean = (None, None) if means is None else (put_heads(m, mesh) for m in means)
    return KVCache(
        k=zeros(),
        v=zeros(),
        k_scale=put_heads(ones, mesh),
        v_scale=put_heads(ones, mesh),
        block_tables=jax.device_put(np.zeros((1, 1), np.int32), tables),
        seq_lens=jax.device_put(np.zeros((1,), np.int32), tables),
        k_mean=k_mean,
        v_mean=v_mean,
    )
