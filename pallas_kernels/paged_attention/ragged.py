"""Ragged paged attention by query tiles: the rows' queries (tokens [T] with per-row starts, as
FlashAttention varlen / vLLM's ``query_start_loc``) cut into tiles of ``block_q`` tokens of one
row each (`ragged_tiles`, plain jnp on small int arrays), the tiles attended by a padded-batch
variant (`reference.paged_attention`'s contract: the reference or the Triton prefill kernel),
and each token's output gathered back. Every size is static in T, R and ``block_q``."""

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from pallas_kernels.paged_attention import reference


class Tiles(NamedTuple):
    """NB = ceil(T / block_q) + R tiles: ``row`` i32[NB] (the row each tile reads), ``tokens``
    i32[NB, block_q] (its tokens; padding 0), ``positions`` i32[NB, block_q] (their positions;
    padding -1), ``seq_lens`` i32[NB] (its row's KV length; 0 for unused tiles); ``tile``,
    ``lane`` i32[T]: where each token's output lies."""

    row: jax.Array
    tokens: jax.Array
    positions: jax.Array
    seq_lens: jax.Array
    tile: jax.Array
    lane: jax.Array


def ragged_tiles(query_start_loc: jax.Array, seq_lens: jax.Array, T: int, block_q: int) -> Tiles:
    """The `Tiles` of rows ``query_start_loc`` i32[R + 1] with KV lengths ``seq_lens`` i32[R]
    (row r's queries are its last ``q_len`` positions) over T tokens."""
    R = seq_lens.shape[0]
    q_len = query_start_loc[1:] - query_start_loc[:-1]
    n_tiles = (q_len + block_q - 1) // block_q
    tile_end = jnp.cumsum(n_tiles)
    tile_start = tile_end - n_tiles
    NB = -(-T // block_q) + R
    i = jnp.arange(NB, dtype=jnp.int32)
    row = jnp.minimum(jnp.searchsorted(tile_end, i, side="right"), R - 1).astype(jnp.int32)
    used = i < tile_end[-1]
    local = (i - tile_start[row])[:, None] * block_q + jnp.arange(block_q, dtype=jnp.int32)
    valid = used[:, None] & (local < q_len[row][:, None])
    tokens = jnp.where(valid, query_start_loc[row][:, None] + local, 0)
    positions = jnp.where(valid, (seq_lens[row] - q_len[row])[:, None] + local, -1)
    t = jnp.arange(T, dtype=jnp.int32)
    t_row = jnp.clip(jnp.searchsorted(query_start_loc, t, side="right") - 1, 0, R - 1)
    t_local = t - query_start_loc[t_row]
    tile = jnp.clip(tile_start[t_row] + t_local // block_q, 0, NB - 1)
    lens = jnp.where(used, seq_lens[row], 0)
    return Tiles(row, tokens, positions, lens, tile, t_local % block_q)


def ragged_paged_attention(
    q: jax.Array,
    k_pool: jax.Array,
    v_pool: jax.Array,
    block_tables: jax.Array,
    seq_lens: jax.Array,
    query_start_loc: jax.Array,
    *,
    layer=0,
    scale: float,
    k_scale: jax.Array | None = None,
    v_scale: jax.Array | None = None,
    attention: Callable = reference.paged_attention,
    block_q: int = 16,
) -> jax.Array:
    """`reference.ragged_paged_attention`'s contract (q [T, N, H] -> [T, N, H] in q.dtype; padded
    tokens' outputs unspecified) through `ragged_tiles` and ``attention`` on
    [NB, ``block_q``, N, H] tiles."""
    tiles = ragged_tiles(query_start_loc, seq_lens, q.shape[0], block_q)
    out = attention(
        q[tiles.tokens],
        k_pool,
        v_pool,
        block_tables[tiles.row],
        tiles.seq_lens,
        tiles.positions,
        layer=layer,
        scale=scale,
        k_scale=k_scale,
        v_scale=v_scale,
    )
    return out[tiles.tile, tiles.lane]
