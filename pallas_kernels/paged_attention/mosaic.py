"""Paged decode attention as a Mosaic GPU Pallas kernel, Hopper (sm_90a). One warpgroup per (row b,
KV head h, split s): h's G query heads in a 64-row tile, keys streamed through ``num_stages``
buffers by TMA, online softmax in f32, ``wgmma``; splits merged by `combine_splits`. Pools read as
``[L * P, ...]`` + ``layer * P`` (`layer_offsets`). Sources: FlashAttention, flash-decoding,
PagedAttention; JAX's attention_mgpu.py."""

import dataclasses
import functools
import math
import types
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.paged_attention import reference
from pallas_kernels.paged_attention.triton_pallas import HIGHEST, LOG2E, NN_DIMS, NT_DIMS, normalize
from pallas_kernels.sizes import raise_first, round_up

_ROWS = 64  # wgmma M: query rows per program (the G heads of one KV head, zero-padded)
_TABLE_COLS = 128  # block-table entries per shared-memory row (TMA boxes are at most 256 wide)
_OFFSET_COLS = 32  # the per-layer page offset input: one 128-byte TMA copy
Q_GROUP_MULTIPLE = 8  # query rows per KV head are zero-padded to a multiple of this (TMA boxes)
_LN2 = math.log(2.0)
_SMS_H100_H200 = 132


@dataclasses.dataclass(frozen=True)
class MosaicDecodeConfig:
    """Static kernel knobs. block_kv: keys per pipeline step (multiple of 64; multiple or divisor
    of page_size); num_stages: K/V shared-memory buffers (2-4); num_splits: sequence splits per
    (row, KV head), None: `_pick_splits`; num_sms: SMs to plan for, None: the device's (or 132)."""

    block_kv: int = 64
    num_stages: int = 2
    num_splits: int | None = None
    num_sms: int | None = None

    def __post_init__(self):
        raise_first(
            [
                (
                    self.block_kv <= 0 or self.block_kv % 64,
                    f"block_kv={self.block_kv} must be a positive multiple of 64",
                ),
                (not 1 <= self.num_stages <= 8, f"num_stages={self.num_stages} must be in 1..8"),
                *[
                    (v is not None and v < 1, f"{k}={v} must be >= 1 or None")
                    for k, v in (("num_splits", self.num_splits), ("num_sms", self.num_sms))
                ],
            ]
        )


@dataclasses.dataclass(frozen=True)
class _Geometry:
    """Static sizes of a launch. Gp: G rounded up to a multiple of 8; pages_per_step: TMA copies per
    K/V buffer; rows_per_copy: min(page_size, block_kv)."""

    G: int
    Gp: int
    H: int
    page_size: int
    block_kv: int
    pages_per_step: int
    rows_per_copy: int
    num_stages: int
    num_splits: int
    dtype: jnp.dtype
    scale: float
    soft_cap: float | None
    sliding_window: int | None


def combine_splits(o: jax.Array, lse: jax.Array, *, num_heads: int, out_dtype) -> jax.Array:
    """Merge split partials (flash-decoding LSE weighting) in jnp. o: f32[B, K, S, Gp, H]
    normalised outputs (rows past G = N / K: padding); lse: f32[B, K, S, Gp] natural-log LSEs
    (-inf: no key). Returns [B, N, H] in ``out_dtype``; rows with no key in any split: zeros."""
    B, K, _, _, H = o.shape
    G = num_heads // K
    mx = jnp.max(lse, axis=2, keepdims=True)
    mx = jnp.where(jnp.isfinite(mx), mx, 0.0)
    w = jnp.exp(lse - mx)  # [B, K, S, Gp]; 0 for empty splits
    out = normalize(jnp.einsum("bksg,bksgh->bkgh", w, o), jnp.sum(w, axis=2))
    return out[:, :, :G].reshape(B, num_heads, H).astype(out_dtype)


def _smem_transforms(dtype, H: int):
    """Tiling + 128-byte swizzle of a [rows, H] operand tile, as wgmma wants it."""
    swizzle_elems = 128 // jnp.dtype(dtype).itemsize
    return (
        ()
        if H % swizzle_elems
        else (plgpu.TilingTransform((8, swizzle_elems)), plgpu.SwizzleTransform(128))
    )


def _wgmma_scores(q_smem, k_smem):
    """[64, H] x [bk, H]^T -> [64, bk] float32."""

    def qk(acc_ref):
        plgpu.wgmma(acc_ref, q_smem, plgpu.transpose_ref(k_smem, (1, 0)))
        return acc_ref[...]

    return pl.run_scoped(qk, plgpu.ACC((_ROWS, k_smem.shape[0]), jnp.float32))


def _wgmma_pv(acc, p, v_smem):
    """acc [64, H] += p [64, bk] (KV dtype, registers) x v [bk, H]."""

    def pv(acc_ref):
        plgpu.wgmma(acc_ref, p, v_smem)

    return pl.run_state(pv)(plgpu.ACC.init(acc))


_WgmmaMath = types.SimpleNamespace(  # Hopper tensor-core math in Mosaic GPU's WGMMA layout
    full=lambda shape, value, row_stat=False: plgpu.layout_cast(
        jnp.full(shape, value, jnp.float32),
        plgpu.Layout.WGMMA.reduce(1) if row_stat else plgpu.Layout.WGMMA,
    ),
    col_iota=lambda shape: plgpu.broadcasted_iota(jnp.int32, shape, 1, layout=plgpu.Layout.WGMMA),
    scores=_wgmma_scores,
    accumulate_pv=_wgmma_pv,
)
_PlainMath = types.SimpleNamespace(  # `_WgmmaMath` in plain jnp (GPU interpret mode on the CPU)
    full=lambda shape, value, row_stat=False: jnp.full(shape, value, jnp.float32),
    col_iota=lambda shape: lax.broadcasted_iota(jnp.int32, shape, 1),
    scores=lambda q_smem, k_smem: lax.dot_general(
        q_smem[...], k_smem[...], NT_DIMS, precision=HIGHEST, preferred_element_type=jnp.float32
    ),
    accumulate_pv=lambda acc, p, v_smem: (
        acc
        + lax.dot_general(
            p, v_smem[...], NN_DIMS, precision=HIGHEST, preferred_element_type=jnp.float32
        )
    ),
)


def _softmax_step(math_, geo: _Geometry, carry, s, first_pos, seq_len, lo_pos, v_smem, wait_v):
    """Online-softmax update with f32 scores ``s`` [64, bk] of keys first_pos.. (m in log2)."""
    acc, m, l = carry
    if geo.soft_cap is None:
        s = s * (geo.scale * LOG2E)
    else:
        s = jnp.tanh(s * (geo.scale / geo.soft_cap)) * (geo.soft_cap * LOG2E)
    pos = math_.col_iota(s.shape) + first_pos
    valid = pos < seq_len
    if geo.sliding_window is not None:
        valid = valid & (pos >= lo_pos)
    s = jnp.where(valid, s, -jnp.inf)
    m_new = jnp.maximum(m, s.max(axis=1))
    alpha, p = jnp.exp2(m - m_new), jnp.exp2(s - lax.broadcast_in_dim(m_new, s.shape, [0]))
    l = l * alpha + p.sum(axis=1)
    acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
    p = p.astype(geo.dtype)
    wait_v()
    acc = math_.accumulate_pv(acc, p, v_smem)
    return acc, m_new, l


def _issue_block(geo: _Geometry, tbl_smem, layer_off, h, step, copies):
    """TMA-copy keys [step * bk, (step + 1) * bk) into one stage; ``copies``: (pool [L * P, K,
    page_size, H], buffer [bk, H], barrier of ``pages_per_step`` arrivals) for K and/or V."""
    rpc = geo.rows_per_copy
    for i in range(geo.pages_per_step):
        token = step * geo.block_kv + i * rpc
        if geo.page_size <= geo.block_kv:
            lp = step * geo.pages_per_step + i  # logical page
            src = lambda ref, phys: ref.at[phys, h]
        else:
            lp, off = lax.div(token, geo.page_size), lax.rem(token, geo.page_size)
            src = lambda ref, phys, off=off: ref.at[phys, h, pl.ds(off, rpc)]
        phys = tbl_smem[1 + lax.div(lp, _TABLE_COLS), lax.rem(lp, _TABLE_COLS)] + layer_off
        for ref, buf, bar in copies:
            plgpu.copy_gmem_to_smem(src(ref, phys), buf.at[pl.ds(i * rpc, rpc)], bar)


class _Program(NamedTuple):
    """What one program's K/V pipeline reads: its refs and its traced int32 scalars."""

    k_ref: Any  # pool [L * P, K, page_size, H] in HBM
    v_ref: Any
    tbl_smem: Any  # i32[1 + R, C]: [0, 0] seq_len, rows 1.. the row's pages
    q_smem: Any  # [64, H]: the KV head's query rows
    q_bar: Any  # barrier of the Q copy
    layer_off: Any  # layer * P: the layer's first page in the flat pool
    h: Any  # KV head
    start: Any  # first KV block of this split
    count: Any  # KV blocks of this split
    seq_len: Any
    lo_pos: Any  # first key position inside the sliding window (0 without one)


def _kv_blocks(geo: _Geometry, seq_len, split):
    """(lo_pos, start, count): the window's first key position, and the KV blocks
    [start, start + count) of split ``split`` (count 0: an empty split)."""
    bk = geo.block_kv
    lo_pos = (
        jnp.int32(0) if geo.sliding_window is None else jnp.maximum(seq_len - geo.sliding_window, 0)
    )
    first_blk = lax.div(lo_pos, bk)
    n_blk = lax.div(seq_len + (bk - 1), bk) - first_blk
    per_split = lax.div(n_blk + (geo.num_splits - 1), geo.num_splits)
    start = first_blk + split * per_split
    return lo_pos, start, jnp.clip(first_blk + n_blk - start, 0, per_split)


def _pipeline(geo: _Geometry, math_, prog: _Program, k_bufs, v_bufs, k_bars, v_bars):
    """The K/V stream: prologue fills ``num_stages`` buffers, each step waits for its K, scores,
    refills K, updates the softmax, refills V. Returns (acc f32[64, H], m, l f32[64])."""
    bk, H, start, count = geo.block_kv, geo.H, prog.start, prog.count
    k_copy = lambda slot: (prog.k_ref, k_bufs.at[slot], k_bars.at[slot])  # noqa: E731
    v_copy = lambda slot: (prog.v_ref, v_bufs.at[slot], v_bars.at[slot])  # noqa: E731
    issue = functools.partial(_issue_block, geo, prog.tbl_smem, prog.layer_off, prog.h)

    for st in range(geo.num_stages):

        @pl.when(st < count)
        def _prologue():  # traced at once by pl.when: st is this iteration's
            issue(start + st, [k_copy(st), v_copy(st)])  # noqa: B023

    plgpu.barrier_wait(prog.q_bar)

    def step(j, carry):
        slot, nxt = lax.rem(j, geo.num_stages), start + j + geo.num_stages
        refill = nxt < start + count
        plgpu.barrier_wait(k_bars.at[slot])
        s = math_.scores(prog.q_smem, k_bufs.at[slot])

        @pl.when(refill)
        def _refill_k():  # Q K^T has completed: this K buffer is free again
            issue(nxt, [k_copy(slot)])

        carry = _softmax_step(
            math_,
            geo,
            carry,
            s,
            (start + j) * bk,
            prog.seq_len,
            prog.lo_pos,
            v_bufs.at[slot],
            lambda: plgpu.barrier_wait(v_bars.at[slot]),
        )

        @pl.when(refill)
        def _refill_v():  # P V has completed
            issue(nxt, [v_copy(slot)])

        return carry

    init = (
        math_.full((_ROWS, H), 0.0),
        math_.full((_ROWS,), -jnp.inf, row_stat=True),
        math_.full((_ROWS,), 0.0, row_stat=True),
    )
    return lax.fori_loop(0, count, step, init)


def _body(
    q_ref, k_ref, v_ref, tbl_ref, off_ref, o_ref, *refs, geo: _Geometry, math_, interpret: bool
):
    lse_ref, q_smem, tbl_smem, off_smem, bars = (None, *refs) if geo.num_splits == 1 else refs
    b, h, split = lax.axis_index("b"), lax.axis_index("h"), lax.axis_index("s")
    tbl_bar, q_bar, off_bar = bars.at[0], bars.at[1], bars.at[2]
    plgpu.copy_gmem_to_smem(tbl_ref.at[b], tbl_smem, tbl_bar)
    plgpu.copy_gmem_to_smem(off_ref, off_smem, off_bar)
    if geo.Gp < _ROWS:  # rows past the real heads: zeros (never stored; keeps them finite)
        q_smem[...] = math_.full((_ROWS, geo.H), 0.0).astype(geo.dtype)
        plgpu.commit_smem()
    plgpu.copy_gmem_to_smem(q_ref.at[b, h], q_smem.at[pl.ds(0, geo.Gp)], q_bar)
    plgpu.barrier_wait(tbl_bar)
    plgpu.barrier_wait(off_bar)
    seq_len = tbl_smem[0, 0]
    lo_pos, start, count = _kv_blocks(geo, seq_len, split)
    prog = _Program(
        k_ref=k_ref,
        v_ref=v_ref,
        tbl_smem=tbl_smem,
        q_smem=q_smem,
        q_bar=q_bar,
        layer_off=off_smem[0],
        h=h,
        start=start,
        count=count,
        seq_len=seq_len,
        lo_pos=lo_pos,
    )
    kv_tile = plgpu.SMEM(
        (geo.num_stages, geo.block_kv, geo.H),
        geo.dtype,
        transforms=() if interpret else _smem_transforms(geo.dtype, geo.H),
    )
    stage_bars = plgpu.Barrier(num_arrivals=geo.pages_per_step, num_barriers=geo.num_stages)
    loop = functools.partial(_pipeline, geo, math_, prog)
    acc, m, l = pl.run_scoped(loop, kv_tile, kv_tile, stage_bars, stage_bars)
    _store(geo, acc, m, l, o_ref, lse_ref, b, h, split)


def _store(geo: _Geometry, acc, m, l, o_ref, lse_ref, b, h, split):
    """Epilogue: one split (``lse_ref`` None): the G rows in the output dtype; else normalised
    partials and natural-log LSE of the Gp rows (zeros and -inf when no key)."""
    has_keys = l > 0.0
    inv_l = jnp.where(has_keys, 1.0 / jnp.where(has_keys, l, 1.0), 0.0)
    out = acc * lax.broadcast_in_dim(inv_l, acc.shape, [0])
    lse = jnp.where(has_keys, m * _LN2 + jnp.log(jnp.where(has_keys, l, 1.0)), -jnp.inf)
    single = lse_ref is None  # one split: the G rows in the output dtype, no LSE

    def store(o_smem, *lse_smem):
        o_smem[...] = out.astype(o_ref.dtype)
        if not single:
            lse_smem[0][...] = lse
        plgpu.commit_smem()
        rows, dst = (geo.G, o_ref.at[b, h]) if single else (geo.Gp, o_ref.at[b, h, split])
        plgpu.copy_smem_to_gmem(o_smem.at[pl.ds(0, rows)], dst)
        if not single:
            plgpu.copy_smem_to_gmem(lse_smem[0].at[pl.ds(0, geo.Gp)], lse_ref.at[b, h, split])
        plgpu.wait_smem_to_gmem(0)

    pl.run_scoped(
        store,
        plgpu.SMEM((_ROWS, geo.H), o_ref.dtype),
        *() if single else (plgpu.SMEM((_ROWS,), jnp.float32),),
    )


def _pick_splits(cfg: MosaicDecodeConfig, rows: int, max_blocks: int, smem: int) -> int:
    """Splits per (row, KV head): the fewest giving >= 1.5 waves of resident programs with < 10%
    of the last wave idle, at most ``max_blocks // 2`` (BENCHMARKS.md section "Throughput")."""
    if cfg.num_splits is not None:
        return max(1, min(cfg.num_splits, max_blocks))
    dev = jax.devices()[0]
    sms = (
        cfg.num_sms
        or (dev.platform == "gpu" and getattr(dev, "core_count", None))
        or _SMS_H100_H200
    )
    cap = max(1, max_blocks // 2)
    slots = sms * max(1, (227 * 1024) // smem)  # programs resident at once
    for splits in range(1, cap + 1):
        waves = rows * splits / slots
        if waves >= 1.5 and waves / math.ceil(waves) >= 0.9:
            return splits
    return cap


def _validate(
    q,
    k_pool,
    v_pool,
    block_tables,
    seq_lens,
    cfg: MosaicDecodeConfig,
    interpret,
    layer,
    page_offset,
    sliding_window,
    soft_cap,
) -> None:
    B, N, H, K, page_size, _ = reference.check_args(
        q, k_pool, v_pool, block_tables, seq_lens, sliding_window, soft_cap
    )
    L = k_pool.shape[0]
    allowed = [jnp.dtype(d) for d in ("bfloat16", "float16", "float32")[: 2 + bool(interpret)]]
    po_shape = getattr(page_offset, "shape", None)
    raise_first(
        [
            (
                not jnp.issubdtype(q.dtype, jnp.floating),
                f"q must be a floating dtype; got {q.dtype}",
            ),
            (B < 1, f"q has B={B} rows; at least 1 is needed"),
            (N % K, f"num query heads N={N} must be a multiple of num KV heads K={K}"),
            (N // K > _ROWS, f"GQA group N/K={N // K} must be <= {_ROWS}"),
            (
                k_pool.dtype not in allowed,
                f"k_pool dtype {k_pool.dtype} not supported; allowed: "
                f"{[d.name for d in allowed]} (float32 only in interpret mode: Hopper wgmma has no "
                "float32 P.V path)",
            ),
            (H % 64, f"head dim H={H} must be a multiple of 64"),
            (page_size % 8, f"page_size={page_size} must be a multiple of 8"),
            (
                cfg.block_kv % page_size and page_size % cfg.block_kv,
                f"block_kv={cfg.block_kv} and page_size={page_size}: one must divide the other",
            ),
            (
                page_offset is not None
                and (po_shape != (_OFFSET_COLS,) or page_offset.dtype != jnp.int32),
                f"page_offset must be i32[{_OFFSET_COLS}] (layer_offsets); got "
                f"{getattr(page_offset, 'dtype', type(page_offset).__name__)}"
                f"{list(po_shape or ())}",
            ),
            (
                isinstance(layer, (int, np.integer)) and not 0 <= layer < L,
                f"layer={layer} is outside the pools' L={L} layers",
            ),
        ]
    )


def _plan(q_shape, pool_shape, M: int, dtype, cfg: MosaicDecodeConfig, scale, soft_cap, window):
    """Static launch plan for q [B, N, H], pools [L, P, K, page_size, H] and tables of width M:
    (_Geometry, R, C) with the table in R rows of C pages (`_table`). ValueError: M too wide."""
    (B, N, H), (_, _, K, page_size, _) = q_shape, pool_shape
    G, bk = N // K, cfg.block_kv
    max_blocks = max(1, -(-M * page_size // bk))
    pages_needed = max_blocks * (bk // page_size) if page_size <= bk else M
    # (1 + R) * C * 4 bytes must be a multiple of 128 (one TMA copy, arrived on by 128 threads).
    C = min(_TABLE_COLS, round_up(pages_needed, 32))
    R = -(-pages_needed // C)  # entry lp lives at [1 + lp // 128, lp % 128] (R == 1 if C < 128)
    if 1 + R > 256:
        raise ValueError(f"block_tables width M={M} too large (max {255 * _TABLE_COLS} pages)")
    isz = jnp.dtype(dtype).itemsize  # shared memory: K/V stages, Q, table, offsets, barriers
    smem = (2 * cfg.num_stages * bk + _ROWS) * H * isz + (1 + R) * C * 4 + _OFFSET_COLS * 4 + 1024
    geo = _Geometry(
        G,
        round_up(G, Q_GROUP_MULTIPLE),
        H,
        page_size,
        bk,
        max(1, bk // page_size),
        min(page_size, bk),
        cfg.num_stages,
        _pick_splits(cfg, B * K, max_blocks, smem),
        dtype,
        float(scale),
        soft_cap,
        window,
    )
    return geo, R, C


def _table(block_tables, seq_lens, page_size: int, R: int, C: int):
    """i32[B, 1 + R, C], shared by all layers: row 0 seq_len (clamped to the table's M *
    page_size), rows 1.. the pages, null-padded; entry lp at [1 + lp // C, lp % C]."""
    B, M = block_tables.shape
    pages = jnp.pad(block_tables.astype(jnp.int32), ((0, 0), (0, R * C - M))).reshape(B, R, C)
    lens = jnp.clip(seq_lens.astype(jnp.int32), 0, M * page_size)
    header = jnp.zeros((B, 1, C), jnp.int32).at[:, 0, 0].set(lens)
    return jnp.concatenate([header, pages], axis=1)


def _launch_kwargs(geo: _Geometry, B: int, K: int, out_dtype, R: int, C: int, interpret: bool):
    """`plgpu.kernel` arguments: outputs (one split: [B, K, G, H] in out_dtype; else f32 partials
    [B, K, S, Gp, H] and LSEs [B, K, S, Gp]), the (b, h, s) grid, Q/table/offset scratch."""
    G, Gp, H, splits, dtype = geo.G, geo.Gp, geo.H, geo.num_splits, geo.dtype
    out_type = (
        (jax.ShapeDtypeStruct((B, K, G, H), out_dtype),)
        if splits == 1
        else (
            jax.ShapeDtypeStruct((B, K, splits, Gp, H), jnp.float32),
            jax.ShapeDtypeStruct((B, K, splits, Gp), jnp.float32),
        )
    )
    transforms = () if interpret else _smem_transforms(dtype, H)
    kw = dict(
        out_type=out_type,
        grid=(B, K, splits),
        grid_names=("b", "h", "s"),
        scratch_types=[
            plgpu.SMEM((_ROWS, H), dtype, transforms=transforms),
            plgpu.SMEM((1 + R, C), jnp.int32),
            plgpu.SMEM((_OFFSET_COLS,), jnp.int32),
            plgpu.Barrier(num_barriers=3),
        ],
    )
    if interpret:  # Mosaic GPU's interpret mode is private in JAX 0.10-0.11 (pyproject's range)
        from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

        kw["interpret"] = InterpretGPUParams()
    else:
        kw["compiler_params"] = plgpu.CompilerParams(approx_math=True)
    return kw


@functools.partial(
    jax.jit, static_argnames=("scale", "soft_cap", "sliding_window", "interpret", "cfg")
)
def _forward(
    q,
    k_pool,
    v_pool,
    block_tables,
    seq_lens,
    layer_off,
    *,
    scale,
    soft_cap,
    sliding_window,
    interpret,
    cfg: MosaicDecodeConfig,
):
    (B, N, H), (L, P, K, page_size, _) = q.shape, k_pool.shape
    dtype = k_pool.dtype
    geo, R, C = _plan(
        q.shape, k_pool.shape, block_tables.shape[1], dtype, cfg, scale, soft_cap, sliding_window
    )
    table = _table(block_tables, seq_lens, page_size, R, C)
    qg = jnp.pad(
        q.astype(dtype).reshape(B, K, geo.G, H), ((0, 0), (0, 0), (0, geo.Gp - geo.G), (0, 0))
    )
    k_flat, v_flat = (x.reshape(L * P, K, page_size, H) for x in (k_pool, v_pool))
    body = functools.partial(
        _body, geo=geo, math_=_PlainMath if interpret else _WgmmaMath, interpret=interpret
    )  # one split: no LSE output (lse_ref None)
    kw = _launch_kwargs(geo, B, K, q.dtype, R, C, interpret)
    outs = plgpu.kernel(body, **kw)(qg, k_flat, v_flat, table, layer_off)
    if geo.num_splits == 1:
        return outs[0].reshape(B, N, H)
    return combine_splits(*outs, num_heads=N, out_dtype=q.dtype)


def layer_offsets(layer, pages_per_layer: int):
    """i32[32]: [0] ``layer * pages_per_layer``, the rest unread; numpy for an int ``layer``."""
    xp = np if isinstance(layer, (int, np.integer)) else jnp
    return xp.arange(_OFFSET_COLS, dtype=np.int32) + xp.asarray(layer, np.int32) * pages_per_layer


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
    interpret: bool = False,
    block_kv: int = 64,
    num_stages: int = 2,
    num_splits: int | None = None,
    config: MosaicDecodeConfig | None = None,
    page_offset: jax.Array | None = None,
) -> jax.Array:
    """`reference.paged_decode_attention`'s contract on Hopper -> [B, N, H] in q.dtype. Pools
    bf16/f16 (f32 only if interpret), H a multiple of 64, page_size of 8.
    Knobs: `MosaicDecodeConfig` (unless ``config``). page_offset: ``layer_offsets(layer, P)``,
    replaces ``layer``. ValueError: shapes, dtypes or knobs the kernel does not take, a Python-int
    layer outside [0, L). Unchecked: a traced layer, page ids; lengths past the table are clamped to
    M * page_size. Eager interpret calls block until ready (XLA:CPU callback deadlock)."""
    cfg = config or MosaicDecodeConfig(block_kv, num_stages, num_splits)
    _validate(
        q,
        k_pool,
        v_pool,
        block_tables,
        seq_lens,
        cfg,
        interpret,
        layer,
        page_offset,
        sliding_window,
        soft_cap,
    )
    out = _forward(
        q,
        k_pool,
        v_pool,
        block_tables,
        seq_lens,
        layer_offsets(layer, k_pool.shape[1]) if page_offset is None else page_offset,
        scale=float(scale),
        soft_cap=None if soft_cap is None else float(soft_cap),
        sliding_window=None if sliding_window is None else int(sliding_window),
        interpret=bool(interpret),
        cfg=cfg,
    )
    if interpret and not isinstance(out, jax.core.Tracer):
        out.block_until_ready()
    return out
