"""Paged prefill attention (T causal query tokens per row) as a Mosaic GPU Pallas kernel, Hopper
(sm_90a): `reference.paged_attention`'s contract, usable as `ragged.ragged_paged_attention`'s
``attention``. fp16/bf16 pools only (fp8 pools: the Triton variant).

Row layout: the T tokens of a row are cut into ``nq`` query tiles of ``tq = min(64 // G, T)``
tokens; a program (grid (B * nq, K)) owns tile i of row b and KV head h, and its 64-row wgmma tile
holds row ``r = t * G + g`` = token ``i * tq + t``, query head ``h * G + g`` for r < tq * G, zeros
past it (position -1: no key visible). E.g. block_q = 16 ragged tiles at G = 4 fill 64 rows.

Pipeline: as the decode kernel (`mosaic`), the row's K/V pages are copied by TMA into
``num_stages`` shared-memory buffers of ``block_kv`` keys, Q K^T and P V by wgmma, online softmax
in f32 with exp2 (`mosaic._softmax_step`, fed scores already masked). A program streams only the
key blocks some of its queries can see: from the earliest sliding-window start of its real tokens
to ``min(seq_len, max position + 1)`` (computed per tile in jnp). The causal mask is per row: each
row's position is loaded from shared memory in the wgmma row layout.

Sources: Dao 2023 (FlashAttention-2: query-tile outer loop, online softmax, causal block skipping);
Kwon et al. 2023 (PagedAttention: block tables); JAX's ``pallas/ops/gpu/attention_mgpu.py``
(Mosaic GPU TMA + wgmma pipeline, exp2 softmax, per-row vectors via ``plgpu.load``)."""

import functools
import types

import jax
import jax.numpy as jnp
from jax import Array, lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.paged_attention import reference
from pallas_kernels.paged_attention.mosaic import (
    _ROWS,
    MosaicDecodeConfig,
    _issue_block,
    _launch_kwargs,
    _PlainMath,
    _plan,
    _Program,
    _smem_transforms,
    _softmax_step,
    _store,
    _table,
    _validate,
    _WgmmaMath,
    layer_offsets,
)

# Running row maximum before any visible key: finite, so that a row with no visible key in a block
# (causal rows, padding) gets exp2(-inf - floor) = 0, never exp2(-inf + inf) = NaN.
_M_FLOOR = -1e30
# Per-row int32 vectors: the row positions of a tile (wgmma row layout on the GPU).
_GpuRows = types.SimpleNamespace(
    **vars(_WgmmaMath),
    rows=lambda ref: plgpu.load(ref, (), layout=plgpu.Layout.WGMMA.reduce(1)),
)
_CpuRows = types.SimpleNamespace(**vars(_PlainMath), rows=lambda ref: ref[...])


def tile_tokens(T: int, G: int) -> int:
    """Query tokens per program, ``tq = min(64 // G, T)`` (G <= 64, T >= 1)."""
    return max(1, min(_ROWS // G, T))


def _mask_logits(s, q_pos, first_pos, *, math_, scale, soft_cap, sliding_window):
    """Scores s f32[64, bk] of keys first_pos.. -> logits, -inf where key k is not visible to row
    r (``k > q_pos[r]``, or ``q_pos[r] - k >= sliding_window``). With a soft cap the logits are
    capped here (natural-log units, `_softmax_step` then scales by 1); without one, unscaled."""
    if soft_cap is not None:
        s = jnp.tanh(s * (scale / soft_cap)) * soft_cap
    k_pos = math_.col_iota(s.shape) + first_pos
    q_pos = lax.broadcast_in_dim(q_pos, s.shape, [0])
    visible = k_pos <= q_pos
    if sliding_window is not None:
        visible = visible & (q_pos - k_pos < sliding_window)
    return jnp.where(visible, s, -jnp.inf)


def _kv_stream(geo, mask, math_, prog: _Program, q_pos, k_bufs, v_bufs, k_bars, v_bars):
    """Blocks [start, start + count) through the ``num_stages`` ring: the prologue issues the
    first stages; step j waits for K, scores and masks it, reissues K (Q K^T done), updates the
    softmax (waiting for V inside), reissues V. -> (acc f32[64, H], m, l f32[64]), m in log2."""
    stages, ring = geo.num_stages, (k_bufs, v_bufs, k_bars, v_bars)

    def load(block, slot, which):  # which: 0 K, 1 V; block j (relative) into ``slot``
        pools = (prog.k_ref, prog.v_ref)
        jobs = [(pools[w], ring[w].at[slot], ring[2 + w].at[slot]) for w in which]
        _issue_block(geo, prog.tbl_smem, prog.layer_off, prog.h, prog.start + block, jobs)

    for first in range(stages):
        pl.when(first < prog.count)(functools.partial(load, first, first, (0, 1)))
    plgpu.barrier_wait(prog.q_bar)

    def step(j, carry):
        slot, later = lax.rem(j, stages), j + stages
        key0 = (prog.start + j) * geo.block_kv
        plgpu.barrier_wait(k_bars.at[slot])
        s = mask(math_.scores(prog.q_smem, k_bufs.at[slot]), q_pos, key0)
        pl.when(later < prog.count)(functools.partial(load, later, slot, (0,)))
        carry = _softmax_step(
            math_,
            geo,
            carry,
            s,
            key0,
            prog.seq_len,
            prog.lo_pos,
            v_bufs.at[slot],
            functools.partial(plgpu.barrier_wait, v_bars.at[slot]),
        )
        pl.when(later < prog.count)(functools.partial(load, later, slot, (1,)))
        return carry

    zeros = math_.full((_ROWS, geo.H), 0.0)
    row = functools.partial(math_.full, (_ROWS,), row_stat=True)
    return lax.fori_loop(0, prog.count, step, (zeros, row(_M_FLOOR), row(0.0)))


def _body(q_ref, k_ref, v_ref, tbl_ref, off_ref, pos_ref, o_ref, *scratch, geo, mask, nq, math_):
    """One program: tile ``bq`` (row ``bq // nq``), KV head h. Inputs as `_forward` lays them out;
    scratch: Q [64, H], table, page offset, 3 barriers, positions i32[2, 64], 1 barrier."""
    q_smem, tbl_smem, off_smem, bars, pos_smem, pos_bar = scratch
    bq, h = lax.axis_index("b"), lax.axis_index("h")
    plgpu.copy_gmem_to_smem(tbl_ref.at[lax.div(bq, nq)], tbl_smem, bars.at[0])
    plgpu.copy_gmem_to_smem(off_ref, off_smem, bars.at[2])
    plgpu.copy_gmem_to_smem(pos_ref.at[bq], pos_smem, pos_bar.at[0])
    plgpu.copy_gmem_to_smem(q_ref.at[bq, h], q_smem, bars.at[1])
    for i in (0, 2):
        plgpu.barrier_wait(bars.at[i])
    plgpu.barrier_wait(pos_bar.at[0])
    prog = _Program(
        k_ref=k_ref,
        v_ref=v_ref,
        tbl_smem=tbl_smem,
        q_smem=q_smem,
        q_bar=bars.at[1],
        layer_off=off_smem[0],
        h=h,
        start=pos_smem[1, 0],
        count=pos_smem[1, 1],
        seq_len=tbl_smem[0, 0],
        lo_pos=jnp.int32(0),  # unused: the window is in ``mask``
    )
    kv_tile = plgpu.SMEM(
        (geo.num_stages, geo.block_kv, geo.H),
        geo.dtype,
        transforms=_smem_transforms(geo.dtype, geo.H) if math_ is _GpuRows else (),
    )
    stage_bars = plgpu.Barrier(num_arrivals=geo.pages_per_step, num_barriers=geo.num_stages)
    stream = functools.partial(_kv_stream, geo, mask, math_, prog, math_.rows(pos_smem.at[0]))
    acc, m, l = pl.run_scoped(stream, kv_tile, kv_tile, stage_bars, stage_bars)
    _store(geo, acc, m, l, o_ref, None, bq, h, None)


def _tile_queries(q, G: int, tq: int, nq: int, dtype):
    """q [B, T, N, H] -> [B * nq, K, 64, H] in ``dtype``: tile (b, i), KV head h, row t * G + g
    = token i * tq + t, head h * G + g; zeros past tq * G rows and past T tokens."""
    B, T, N, H = q.shape
    K = N // G
    x = jnp.pad(q.astype(dtype), ((0, 0), (0, nq * tq - T), (0, 0), (0, 0)))
    x = x.reshape(B, nq, tq, K, G, H).transpose(0, 1, 3, 2, 4, 5).reshape(B, nq, K, tq * G, H)
    x = jnp.pad(x, ((0, 0), (0, 0), (0, 0), (0, _ROWS - tq * G), (0, 0)))
    return x.reshape(B * nq, K, _ROWS, H)


def _untile(out, q_shape, tq: int, nq: int):
    """Undo `_tile_queries` on the kernel's output [B * nq, K, 64, H] -> [B, T, N, H]."""
    B, T, N, H = q_shape
    K = out.shape[1]
    x = out[:, :, : tq * (N // K)].reshape(B, nq, K, tq, N // K, H)
    return x.transpose(0, 1, 3, 2, 4, 5).reshape(B, nq * tq, N, H)[:, :T]


def _tile_positions(q_positions, seq_lens, *, G, tq, nq, block_kv, sliding_window, max_len):
    """i32[B * nq, 2, 64] per tile: row 0 the 64 rows' positions (-1: padding), row 1 [start,
    count, 0...]: the key blocks of ``block_kv`` [start, start + count) holding a key visible
    to one of its tokens (seq_len clamped to ``max_len``; count 0: none)."""
    B, T = q_positions.shape
    pos = jnp.pad(q_positions.astype(jnp.int32), ((0, 0), (0, nq * tq - T)), constant_values=-1)
    pos = pos.reshape(B * nq, tq)
    lens = jnp.repeat(jnp.clip(seq_lens.astype(jnp.int32), 0, max_len), nq)
    hi = jnp.minimum(lens, pos.max(axis=1) + 1)
    lo = jnp.zeros_like(hi)
    if sliding_window is not None:
        first = jnp.where(pos >= 0, pos, jnp.iinfo(jnp.int32).max).min(axis=1)
        lo = jnp.clip(first - (sliding_window - 1), 0, hi)
    start = lo // block_kv
    count = jnp.maximum(-(-hi // block_kv) - start, 0)
    rows = jnp.pad(jnp.repeat(pos, G, axis=1), ((0, 0), (0, _ROWS - tq * G)), constant_values=-1)
    meta = jnp.zeros((B * nq, _ROWS), jnp.int32).at[:, 0].set(start).at[:, 1].set(count)
    return jnp.stack([rows, meta], axis=1)


@functools.partial(
    jax.jit, static_argnames=("scale", "soft_cap", "sliding_window", "interpret", "cfg")
)
def _forward(q, k_pool, v_pool, block_tables, seq_lens, q_positions, layer_off, **static) -> Array:
    """The launch: ``static`` = scale, soft_cap, sliding_window, interpret, cfg (one split)."""
    (B, T, N, H), (L, P, K, page_size, _) = q.shape, k_pool.shape
    scale, soft_cap, window, cfg = (
        static[k] for k in ("scale", "soft_cap", "sliding_window", "cfg")
    )
    G, M, interpret = N // K, block_tables.shape[1], static["interpret"]
    tq = tile_tokens(T, G)
    nq = -(-T // tq)
    # The decode plan of B * nq "rows" with 64 heads per KV head: G = Gp = 64 rows, stored whole.
    geo, R, C = _plan(
        (B * nq, _ROWS * K, H),
        k_pool.shape,
        M,
        k_pool.dtype,
        cfg,
        scale if soft_cap is None else 1.0,  # a soft cap is applied, scale included, by `mask`
        None,
        None,
    )
    mask = functools.partial(_mask_logits, scale=scale, soft_cap=soft_cap, sliding_window=window)
    math_ = _CpuRows if interpret else _GpuRows
    kw = _launch_kwargs(geo, B * nq, K, q.dtype, R, C, interpret)
    kw["scratch_types"] += [plgpu.SMEM((2, _ROWS), jnp.int32), plgpu.Barrier(num_barriers=1)]
    body = functools.partial(
        _body, geo=geo, mask=functools.partial(mask, math_=math_), nq=nq, math_=math_
    )
    pos = _tile_positions(
        q_positions,
        seq_lens,
        G=G,
        tq=tq,
        nq=nq,
        block_kv=cfg.block_kv,
        sliding_window=window,
        max_len=M * page_size,
    )
    (out,) = plgpu.kernel(body, **kw)(
        _tile_queries(q, G, tq, nq, k_pool.dtype),
        *(x.reshape(L * P, K, page_size, H) for x in (k_pool, v_pool)),
        _table(block_tables, seq_lens, page_size, R, C),
        layer_off,
        pos,
    )
    return _untile(out, q.shape, tq, nq)


def _check_prefill(q, k_pool, v_pool, block_tables, seq_lens, q_positions, k_scale, v_scale, kw):
    """Argument checks (ValueError naming the value and what is allowed) -> (B, T). ``kw``: the
    decode checks' knobs (cfg, interpret, layer, sliding_window, soft_cap), run when B, T > 0."""
    B, N, H, *_ = reference.check_args(
        q, k_pool, v_pool, block_tables, seq_lens, kw["sliding_window"], kw["soft_cap"], ndim=4
    )
    T = q.shape[1]
    if q_positions.shape != (B, T) or not jnp.issubdtype(q_positions.dtype, jnp.integer):
        raise ValueError(
            f"q_positions must be i32[B={B}, T={T}]; got "
            f"{q_positions.dtype}{list(q_positions.shape)}"
        )
    if k_scale is not None or v_scale is not None:
        raise ValueError(
            "k_scale/v_scale given: fp8 KV pages are not supported by the Mosaic prefill kernel "
            "(allowed: None, with bfloat16/float16 pools; fp8: prefill variant 'triton')"
        )
    if B and T:  # the decode kernel's dtype, head-dim, page, group, knob and layer checks
        q3 = jax.ShapeDtypeStruct((B, N, H), q.dtype)
        _validate(q3, k_pool, v_pool, block_tables, seq_lens, page_offset=None, **kw)
    return B, T


def paged_prefill_attention(
    q: Array,
    k_pool: Array,
    v_pool: Array,
    block_tables: Array,
    seq_lens: Array,
    q_positions: Array,
    *,
    scale: float,
    layer=0,
    soft_cap: float | None = None,
    sliding_window: int | None = None,
    k_scale: Array | None = None,
    v_scale: Array | None = None,
    interpret: bool = False,
    block_kv: int = 64,
    num_stages: int = 2,
) -> Array:
    """`reference.paged_attention`'s contract on Hopper -> [B, T, N, H] in q.dtype (empty, no
    launch, if B or T is 0). q [B, T, N, H] (cast to the pools' dtype); pools [L, P, K, page_size,
    H] bf16/f16 (f32 only if ``interpret``: the Mosaic GPU interpreter on the CPU); block_tables
    i32[B, M]; seq_lens i32[B]; q_positions i32[B, T] (-1: padding); layer int or i32[].
    H a multiple of 64, page_size of 8, G = N / K <= 64; block_kv: keys per pipeline step (a
    multiple of 64, a multiple or divisor of page_size); num_stages: K/V buffers (1-8).
    ValueError: bad shapes, dtypes or knobs, fp8 scales, a Python-int layer outside [0, L).
    Unchecked: a traced layer, page ids; lengths past the table are clamped to M * page_size."""
    arrays = (q, k_pool, v_pool, block_tables, seq_lens, q_positions)
    cfg = MosaicDecodeConfig(block_kv, num_stages, num_splits=1)
    knobs = dict(cfg=cfg, interpret=bool(interpret), sliding_window=sliding_window)
    B, T = _check_prefill(*arrays, k_scale, v_scale, dict(knobs, layer=layer, soft_cap=soft_cap))
    if not (B and T):
        return jnp.zeros(q.shape, q.dtype)
    out = _forward(
        *arrays,
        layer_offsets(layer, k_pool.shape[1]),
        scale=float(scale),
        soft_cap=None if soft_cap is None else float(soft_cap),
        **dict(knobs, sliding_window=None if sliding_window is None else int(sliding_window)),
    )
    if interpret and not isinstance(out, jax.core.Tracer):
        out.block_until_ready()  # eager interpret calls: no dispatch while its callbacks run
    return out
