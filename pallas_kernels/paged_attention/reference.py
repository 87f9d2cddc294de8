"""Plain-jnp float32 paged attention (gather, then dense), the oracle of every kernel variant; GQA:
query head n reads KV head n // G; fp8 pools dequantised on read. Source: PagedAttention (vLLM)."""

import jax
import jax.numpy as jnp

from pallas_kernels.sizes import raise_first


def check_args(
    q, k_pool, v_pool, block_tables, seq_lens, sliding_window=None, soft_cap=None, ndim: int = 3
) -> tuple[int, int, int, int, int, int]:
    """Checks of every variant, q [B, N, H] (``ndim`` 4: [B, T, N, H]) -> (B, N, H, K, page_size,
    M); ValueError names the argument."""
    if q.ndim != ndim:
        raise ValueError(f"q must be [B, {'T, ' * (ndim == 4)}N, H]; got shape {q.shape}")
    if k_pool.ndim != 5 or v_pool.shape != k_pool.shape or v_pool.dtype != k_pool.dtype:
        raise ValueError(
            f"k_pool, v_pool must both be [L, P, K, page_size, H] of one dtype; got "
            f"{k_pool.dtype}{list(k_pool.shape)} and {v_pool.dtype}{list(v_pool.shape)}"
        )
    (B, *_, N, H), (*_, K, page_size, Hk) = q.shape, k_pool.shape
    raise_first(
        [
            (Hk != H, f"k_pool head dim {Hk} must equal q head dim {H}"),
            (
                block_tables.ndim != 2 or block_tables.shape[0] != B,
                f"block_tables must be i32[B={B}, M]; got shape {block_tables.shape}",
            ),
            (seq_lens.shape != (B,), f"seq_lens must be i32[B={B}]; got shape {seq_lens.shape}"),
            (
                sliding_window is not None and sliding_window < 1,
                f"sliding_window={sliding_window} must be None or >= 1",
            ),
            (soft_cap is not None and not soft_cap > 0, f"soft_cap={soft_cap} must be None or > 0"),
        ]
    )
    return B, N, H, K, page_size, block_tables.shape[1]


def _dequantised(pages: jax.Array, scale: jax.Array | None, layer) -> jax.Array:
    """pages [B, M, K, page_size, H] in f32, times ``scale[layer]`` f32[K] per head if given."""
    pages = pages.astype(jnp.float32)
    return pages if scale is None else pages * scale[layer][None, None, :, None, None]


def paged_attention(
    q: jax.Array,
    k_pool: jax.Array,
    v_pool: jax.Array,
    block_tables: jax.Array,
    seq_lens: jax.Array,
    q_positions: jax.Array,
    *,
    layer=0,
    scale: float,
    soft_cap: float | None = None,
    sliding_window: int | None = None,
    k_scale: jax.Array | None = None,
    v_scale: jax.Array | None = None,
) -> jax.Array:
    """Attention of T query tokens per sequence over its paged KV -> [B, T, N, H] in q.dtype (rows
    with no visible key: zeros). q: [B, T, N, H] (RoPE applied); k_pool, v_pool: [L, P, K,
    page_size, H], this step's K/V written; block_tables: i32[B, M] physical page of each logical
    page (padding: null page 0); seq_lens: i32[B] (0 for padded rows); q_positions: i32[B, T]: key j
    is visible to a query at p iff ``j <= p``, ``j < seq_len`` (and ``p - j < sliding_window`` if
    set); layer: int or i32[] into L; soft_cap: logits become ``soft_cap * tanh(logits / soft_cap)``
    (Gemma 2); k_scale, v_scale: None, or f32[L, K] per-head scales of fp8 pages."""
    B, T, N, H = q.shape
    K, G, S = k_pool.shape[2], N // k_pool.shape[2], block_tables.shape[1] * k_pool.shape[3]
    # Gather pages: [B, M, K, page_size, H] -> [B, K, S, H]
    k, v = (
        _dequantised(p[layer, block_tables], s, layer).transpose(0, 2, 1, 3, 4).reshape(B, K, S, H)
        for p, s in ((k_pool, k_scale), (v_pool, v_scale))
    )
    qf = q.astype(jnp.float32).reshape(B, T, K, G, H)
    logits = jnp.einsum("btkgh,bksh->bkgts", qf, k) * scale
    if soft_cap is not None:
        logits = soft_cap * jnp.tanh(logits / soft_cap)
    kpos = jnp.arange(S, dtype=jnp.int32)[None, None, :]  # [1, 1, S]
    qpos = q_positions[:, :, None]  # [B, T, 1]
    visible = (kpos <= qpos) & (kpos < seq_lens[:, None, None])  # [B, T, S]
    if sliding_window is not None:
        visible &= (qpos - kpos) < sliding_window
    visible = visible[:, None, None]  # [B, 1, 1, T, S]
    logits = jnp.where(visible, logits, -jnp.inf)
    m = jnp.max(logits, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.where(visible, jnp.exp(logits - m), 0.0)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    out = jnp.einsum("bkgts,bksh->btkgh", p, v) / jnp.maximum(denom, 1e-30).transpose(0, 3, 1, 2, 4)
    return out.reshape(B, T, N, H).astype(q.dtype)


def paged_decode_attention(
    q: jax.Array,
    k_pool: jax.Array,
    v_pool: jax.Array,
    block_tables: jax.Array,
    seq_lens: jax.Array,
    *,
    layer=0,
    scale: float,
    soft_cap: float | None = None,
    sliding_window: int | None = None,
    k_scale: jax.Array | None = None,
    v_scale: jax.Array | None = None,
) -> jax.Array:
    """Decode: q [B, N, H] at position ``seq_len - 1`` -> [B, N, H]; else as `paged_attention`."""
    return paged_attention(
        q[:, None],
        k_pool,
        v_pool,
        block_tables,
        seq_lens,
        (seq_lens - 1)[:, None],
        layer=layer,
        scale=scale,
        soft_cap=soft_cap,
        sliding_window=sliding_window,
        k_scale=k_scale,
        v_scale=v_scale,
    )[:, 0]


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
) -> jax.Array:
    """Ragged rows, token by token (the oracle of `ragged.ragged_paged_attention`; memory T x S):
    q [T, N, H]; row r's queries are tokens ``[query_start_loc[r], query_start_loc[r + 1])``
    (i32[R + 1], non-decreasing), the last ``q_len`` positions of its ``seq_lens[r]`` keys, so
    token i of the row sits at ``seq_lens[r] - q_len + i`` and sees keys up to it; tokens past
    ``query_start_loc[R]`` are padding (zeros). Pools, tables, scales as `paged_attention`.
    Source: FlashAttention's varlen ``cu_seqlens``; vLLM's ``query_start_loc``."""
    T = q.shape[0]
    t = jnp.arange(T, dtype=jnp.int32)
    row = jnp.clip(jnp.searchsorted(query_start_loc, t, side="right") - 1, 0, seq_lens.shape[0] - 1)
    starts, ends = query_start_loc[row], query_start_loc[row + 1]
    real = (t >= starts) & (t < ends)
    pos = jnp.where(real, seq_lens[row] - (ends - starts) + (t - starts), -1)
    out = paged_attention(
        q[:, None],
        k_pool,
        v_pool,
        block_tables[row],
        jnp.where(real, seq_lens[row], 0),
        pos[:, None],
        layer=layer,
        scale=scale,
        k_scale=k_scale,
        v_scale=v_scale,
    )[:, 0]
    return jnp.where(real[:, None, None], out, 0).astype(q.dtype)
