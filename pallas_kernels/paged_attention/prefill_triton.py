"""Paged prefill attention (T causal query tokens per row) as a Pallas/Triton kernel (prefill
variant ``triton``). One program per (row b, KV head k, query tile i): ``block_q`` tokens x the G
query heads of KV head k as one ``[block_q * G_PAD, H]`` matrix (row r: token ``r // G_PAD``, head
``r % G_PAD``; G zero-padded to a power of 2); online softmax and fp8 pages as `triton_pallas`.
Sources: Dao 2023 (FlashAttention-2); Kwon et al. 2023 (PagedAttention)."""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.kv_quant import check_scales
from pallas_kernels.paged_attention.triton_pallas import (
    LOG2E,
    MIN_MMA_ROWS,
    NEG_INIT,
    check_decode_args,
    check_knobs,
    full_block,
    layer_scales,
    normalize,
    online_softmax_step,
)
from pallas_kernels.sizes import is_pow2, next_pow2

DEFAULT_ROWS = DEFAULT_KEYS = 64  # default tile: query rows (tokens x padded group), keys per step


def _kernel(
    layer_ref,
    lens_ref,
    bt_ref,
    ks_ref,
    vs_ref,
    pos_ref,
    q_ref,
    k_ref,
    v_ref,
    o_ref,
    *,
    ROWS,
    H,
    M,
    page_size,
    pages_per_block,
    scale,
    soft_cap,
    sliding_window,
):
    b, kh = pl.program_id(0), pl.program_id(1)
    layer = layer_ref[0]
    seq_len = jnp.minimum(lens_ref[b], M * page_size)  # never past the table
    pos = pos_ref[...]  # [ROWS] (-1: padding)
    q = q_ref[...].reshape(ROWS, H)  # [ROWS, H] (from [block_q, G, H])
    block_n = pages_per_block * page_size
    # Keys [lo, hi) can be visible to some query of this tile.
    hi = jnp.minimum(seq_len, jnp.max(pos) + 1)
    lo = (
        jnp.int32(0)
        if sliding_window is None
        else jnp.maximum(jnp.min(jnp.where(pos >= 0, pos, hi)) - (sliding_window - 1), 0)
    )
    blk_lo = lo // block_n
    blk_hi = jnp.maximum((hi + block_n - 1) // block_n, blk_lo)
    qk_scale = (scale if soft_cap is not None else scale * LOG2E) * ks_ref[kh]
    offs = jnp.arange(block_n, dtype=jnp.int32)
    tok_page, slot = offs // page_size, offs % page_size  # each key's page and slot

    def body(blk, carry):
        p0 = blk * pages_per_block
        pages = bt_ref[b, p0 + tok_page]  # [BLOCK_N]
        kpos = p0 * page_size + offs
        valid = (kpos[None, :] <= pos[:, None]) & (kpos[None, :] < seq_len)
        if sliding_window is not None:
            valid &= (pos[:, None] - kpos[None, :]) < sliding_window
        return online_softmax_step(
            q,
            k_ref[layer, pages, kh, slot],
            v_ref[layer, pages, kh, slot],
            valid,
            carry,
            qk_scale=qk_scale,
            soft_cap=soft_cap,
        )

    init = (
        jnp.zeros((ROWS, H), jnp.float32),
        jnp.full((ROWS,), NEG_INIT, jnp.float32),
        jnp.zeros((ROWS,), jnp.float32),
    )
    acc, _, l_i = lax.fori_loop(blk_lo, blk_hi, body, init)
    acc = acc * vs_ref[kh]
    o_ref[...] = normalize(acc, l_i).reshape(o_ref.shape).astype(o_ref.dtype)


@functools.partial(
    jax.jit,
    static_argnames=(
        "scale",
        "soft_cap",
        "sliding_window",
        "interpret",
        "block_q",
        "pages_per_block",
        "num_warps",
        "num_stages",
    ),
)
def _paged_prefill(
    q,
    k_pool,
    v_pool,
    block_tables,
    seq_lens,
    q_positions,
    layer,
    k_scale,
    v_scale,
    *,
    scale,
    soft_cap,
    sliding_window,
    interpret,
    block_q,
    pages_per_block,
    num_warps,
    num_stages,
):
    (B, T, N, H), (L, _, K, page_size, _) = q.shape, k_pool.shape
    G, M, nq = N // K, block_tables.shape[1], -(-T // block_q)
    G_PAD, Tp = next_pow2(G), nq * block_q
    ROWS = block_q * G_PAD
    if G == G_PAD:
        qg = q.reshape(B, T, K, G, H)
        if Tp != T:
            qg = jnp.pad(qg, ((0, 0), (0, Tp - T), (0, 0), (0, 0), (0, 0)))
        tile = pl.BlockSpec((None, block_q, None, G, H), lambda b, k, i: (b, i, k, 0, 0))
        out_shape = (B, Tp, K, G, H)
    else:  # pad G to G_PAD with zero rows: tiles of [B, K, Tp * G_PAD, H]
        qg = q.reshape(B, T, K, G, H).transpose(0, 2, 1, 3, 4)  # [B, K, T, G, H]
        qg = jnp.pad(qg, ((0, 0), (0, 0), (0, Tp - T), (0, G_PAD - G), (0, 0)))
        qg = qg.reshape(B, K, Tp * G_PAD, H)
        tile = pl.BlockSpec((None, None, ROWS, H), lambda b, k, i: (b, k, i, 0))
        out_shape = (B, K, Tp * G_PAD, H)
    pos = jnp.pad(q_positions.astype(jnp.int32), ((0, 0), (0, Tp - T)), constant_values=-1)
    pos_rows = jnp.repeat(pos, G_PAD, axis=1)  # [B, Tp * G_PAD]
    bt = jnp.pad(block_tables, ((0, 0), (0, pages_per_block)))
    scales = layer_scales(k_scale, v_scale, layer, L, K)
    kernel = functools.partial(
        _kernel,
        ROWS=ROWS,
        H=H,
        M=M,
        page_size=page_size,
        pages_per_block=pages_per_block,
        scale=float(scale),
        soft_cap=None if soft_cap is None else float(soft_cap),
        sliding_window=sliding_window,
    )
    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(out_shape, q.dtype),
        grid=(B, K, nq),
        in_specs=[
            full_block((1,)),
            full_block((B,)),
            full_block((B, M + pages_per_block)),
            full_block((K,)),
            full_block((K,)),
            pl.BlockSpec((None, ROWS), lambda b, k, i: (b, i)),
            tile,
            full_block(k_pool.shape),
            full_block(v_pool.shape),
        ],
        out_specs=tile,
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        name=f"paged_prefill_triton_r{ROWS}_ppb{pages_per_block}",
    )(jnp.asarray(layer, jnp.int32).reshape(1), seq_lens, bt, *scales, pos_rows, qg, k_pool, v_pool)
    if G == G_PAD:
        return out[:, :T].reshape(B, T, N, H)
    out = out.reshape(B, K, Tp, G_PAD, H)[:, :, :T, :G]
    return out.transpose(0, 2, 1, 3, 4).reshape(B, T, N, H)


def paged_prefill_attention(
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
    interpret: bool = False,
    block_q: int | None = None,
    pages_per_block: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    k_scale: jax.Array | None = None,
    v_scale: jax.Array | None = None,
) -> jax.Array:
    """`reference.paged_attention`'s contract (prefill chunks) in Pallas/Triton -> [B, T, N, H] in
    q.dtype (empty, no launch, if B or T is 0). q bf16/f16/f32; pools q's dtype or fp8 (with
    k_scale, v_scale f32[L, K]); page_size, H powers of 2 (H >= 16); block_q: query tokens per
    program (``block_q * G_PAD`` a power of 2 >= 16); pages_per_block: per key block (>= 16 keys);
    None knobs: 64 query rows and 64 keys (one page if pages are larger), 4 warps, 2 stages.
    ValueError: bad shapes, dtypes, knobs."""
    B, N, H, K, page_size, _ = check_decode_args(
        q, k_pool, v_pool, block_tables, seq_lens, sliding_window, soft_cap, ndim=4
    )
    T = q.shape[1]
    if q_positions.shape != (B, T):
        raise ValueError(f"q_positions must be i32[B={B}, T={T}]; got shape {q_positions.shape}")
    knobs = {
        k: default if v is None else v
        for k, v, default in (
            ("block_q", block_q, max(1, DEFAULT_ROWS // next_pow2(N // K))),
            ("pages_per_block", pages_per_block, max(1, DEFAULT_KEYS // page_size)),
            ("num_warps", num_warps, 4),
            ("num_stages", num_stages, 2),
        )
    }
    rows = knobs["block_q"] * next_pow2(N // K)
    if not (is_pow2(rows) and rows >= MIN_MMA_ROWS):
        raise ValueError(
            f"block_q={knobs['block_q']} gives {rows} query rows per program "
            f"(block_q x {next_pow2(N // K)} padded heads); must be a power of 2 "
            f">= {MIN_MMA_ROWS}"
        )
    check_knobs(knobs["pages_per_block"], 1, knobs["num_warps"], knobs["num_stages"], page_size)
    check_scales(k_pool, k_scale, v_scale)
    if T == 0 or B == 0:  # no queries: nothing to launch (as the reference, an empty result)
        return jnp.zeros((B, T, N, H), q.dtype)
    return _paged_prefill(
        q,
        k_pool,
        v_pool,
        block_tables,
        seq_lens,
        q_positions,
        layer,
        k_scale,
        v_scale,
        scale=float(scale),
        soft_cap=soft_cap,
        sliding_window=sliding_window,
        interpret=bool(interpret),
        **knobs,
    )
