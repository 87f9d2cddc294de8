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
    MIN_MMA_ROWS,
    block_slots,
    check_decode_args,
    check_knobs,
    full_block,
    init_state,
    layer_scales,
    logit_scale,
    normalize,
    online_softmax_step,
)
from pallas_kernels.sizes import is_pow2, next_pow2

DEFAULT_ROWS = DEFAULT_KEYS = 64  # default tile: query rows (tokens x padded group), keys per step


def _visible_blocks(pos, seq_len, block_n: int, sliding_window):
    """The key blocks [blk_lo, blk_hi) (i32 scalars, blk_hi >= blk_lo) of BLOCK_N = block_n keys
    that can hold a key visible to some query of the tile: keys [lo, hi), hi = min(seq_len,
    max(pos) + 1), lo the earliest window start of a real row (0 without a sliding window).
    pos: i32[ROWS] query positions (-1: padding); seq_len: i32 scalar."""
    hi = jnp.minimum(seq_len, jnp.max(pos) + 1)
    lo = (
        jnp.int32(0)
        if sliding_window is None
        else jnp.maximum(jnp.min(jnp.where(pos >= 0, pos, hi)) - (sliding_window - 1), 0)
    )
    blk_lo = lo // block_n
    blk_hi = jnp.maximum((hi + block_n - 1) // block_n, blk_lo)
    return blk_lo, blk_hi


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
    blk_lo, blk_hi = _visible_blocks(pos, seq_len, pages_per_block * page_size, sliding_window)
    qk_scale = logit_scale(scale, soft_cap) * ks_ref[kh]
    offs, tok_page, slot = block_slots(page_size, pages_per_block)

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

    acc, _, l_i = lax.fori_loop(blk_lo, blk_hi, body, init_state(ROWS, H))
    acc = acc * vs_ref[kh]
    o_ref[...] = normalize(acc, l_i).reshape(o_ref.shape).astype(o_ref.dtype)


def _group_queries(q, *, K: int, G_PAD: int, block_q: int, Tp: int):
    """Lay q [B, T, N, H] out as `_kernel`'s query tiles of ROWS = block_q * G_PAD rows on grid
    (B, K, Tp // block_q), T zero-padded to Tp -> (qg, tile, out_shape). G == G_PAD: qg
    [B, Tp, K, G, H], a tile [block_q, G, H]; else G zero-padded to G_PAD: qg [B, K, Tp * G_PAD, H]
    (row r of a tile: token r // G_PAD, head r % G_PAD), a tile [ROWS, H]. The output, out_shape
    in q's dtype, has qg's layout and tiles (`_ungroup` undoes it)."""
    B, T, N, H = q.shape
    G = N // K
    if G == G_PAD:
        qg = q.reshape(B, T, K, G, H)
        if Tp != T:
            qg = jnp.pad(qg, ((0, 0), (0, Tp - T), (0, 0), (0, 0), (0, 0)))
        tile = pl.BlockSpec((None, block_q, None, G, H), lambda b, k, i: (b, i, k, 0, 0))
        return qg, tile, (B, Tp, K, G, H)
    # pad G to G_PAD with zero rows: tiles of [B, K, Tp * G_PAD, H]
    qg = q.reshape(B, T, K, G, H).transpose(0, 2, 1, 3, 4)  # [B, K, T, G, H]
    qg = jnp.pad(qg, ((0, 0), (0, 0), (0, Tp - T), (0, G_PAD - G), (0, 0)))
    qg = qg.reshape(B, K, Tp * G_PAD, H)
    tile = pl.BlockSpec((None, None, block_q * G_PAD, H), lambda b, k, i: (b, k, i, 0))
    return qg, tile, (B, K, Tp * G_PAD, H)


def _ungroup(out, q_shape, *, K: int, G_PAD: int):
    """Undo `_group_queries`: the kernel's output (its out_shape, q's dtype) -> q_shape
    [B, T, N, H]."""
    B, T, N, H = q_shape
    G = N // K
    if G == G_PAD:
        return out[:, :T].reshape(B, T, N, H)
    out = out.reshape(B, K, -1, G_PAD, H)[:, :, :T, :G]
    return out.transpose(0, 2, 1, 3, 4).reshape(B, T, N, H)


def _prefill_in_specs(tile, pool_shape, *, B: int, K: int, M: int, ROWS: int, pages_per_block: int):
    """`_kernel`'s input BlockSpecs on grid (B, K, nq): layer i32[1], seq_lens i32[B], padded
    tables i32[B, M + pages_per_block], K and V scales f32[K] (all whole), row positions
    i32[B, Tp * G_PAD] (ROWS a program), the q tile, both pools (pool_shape, whole)."""
    return [
        full_block((1,)),
        full_block((B,)),
        full_block((B, M + pages_per_block)),
        full_block((K,)),
        full_block((K,)),
        pl.BlockSpec((None, ROWS), lambda b, k, i: (b, i)),
        tile,
        full_block(pool_shape),
        full_block(pool_shape),
    ]


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
    qg, tile, out_shape = _group_queries(q, K=K, G_PAD=G_PAD, block_q=block_q, Tp=Tp)
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
        in_specs=_prefill_in_specs(
            tile, k_pool.shape, B=B, K=K, M=M, ROWS=ROWS, pages_per_block=pages_per_block
        ),
        out_specs=tile,
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        name=f"paged_prefill_triton_r{ROWS}_ppb{pages_per_block}",
    )(jnp.asarray(layer, jnp.int32).reshape(1), seq_lens, bt, *scales, pos_rows, qg, k_pool, v_pool)
    return _ungroup(out, q.shape, K=K, G_PAD=G_PAD)


def _prefill_knobs(
    *, G: int, page_size: int, block_q, pages_per_block, num_warps, num_stages
) -> dict[str, int]:
    """The knobs, None ones defaulted (64 query rows, 64 keys but at least one page, 4 warps,
    2 stages) and checked -> {block_q, pages_per_block, num_warps, num_stages}. ValueError if
    block_q * G_PAD (G_PAD = next_pow2(G)) is not a power of 2 >= MIN_MMA_ROWS, or as
    `check_knobs`."""
    knobs = {
        k: default if v is None else v
        for k, v, default in (
            ("block_q", block_q, max(1, DEFAULT_ROWS // next_pow2(G))),
            ("pages_per_block", pages_per_block, max(1, DEFAULT_KEYS // page_size)),
            ("num_warps", num_warps, 4),
            ("num_stages", num_stages, 2),
        )
    }
    rows = knobs["block_q"] * next_pow2(G)
    if not (is_pow2(rows) and rows >= MIN_MMA_ROWS):
        raise ValueError(
            f"block_q={knobs['block_q']} gives {rows} query rows per program "
            f"(block_q x {next_pow2(G)} padded heads); must be a power of 2 "
            f">= {MIN_MMA_ROWS}"
        )
    check_knobs(knobs["pages_per_block"], 1, knobs["num_warps"], knobs["num_stages"], page_size)
    return knobs


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
    knobs = _prefill_knobs(
        G=N // K,
        page_size=page_size,
        block_q=block_q,
        pages_per_block=pages_per_block,
        num_warps=num_warps,
        num_stages=num_stages,
    )
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
