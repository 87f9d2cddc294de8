"""Paged decode attention: a plain Triton kernel called through jax-triton (variant ``jax_triton``).

`triton_pallas`'s algorithm in Triton: masked loads replace the q and block-table padding, K/V rows
past the sequence end are not read, one split stores straight into ``[B, N, H]``. Needs ``triton``,
``jax_triton`` (the ``jax-triton`` extra; imports without them) and a CUDA GPU. Sources: as
`triton_pallas`; Triton's fused-attention tutorial (online-softmax loop)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

try:  # optional: only this variant needs Triton (and jax_triton, imported on first call)
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = tl = None

from pallas_kernels.paged_attention import tuning
from pallas_kernels.paged_attention.triton_pallas import (
    LOG2E, check_decode_args, check_knobs, combine_splits, padded_group)


_jit = (lambda fn: fn) if triton is None else triton.jit  # without Triton: never launched


@_jit
def _dot(a, b, IEEE: tl.constexpr):
    """a @ b in float32; IEEE float32 products for float32 inputs (else tf32)."""
    if IEEE:
        out = tl.dot(a, b, input_precision="ieee")
    else:
        out = tl.dot(a, b)
    return out


@_jit
def _paged_decode_kernel(
        q_ptr, k_ptr, v_ptr, bt_ptr, lens_ptr, layer_ptr, o_ptr, m_ptr, l_ptr,
        QK_SCALE: tl.constexpr, SOFT_CAP: tl.constexpr, WINDOW: tl.constexpr,
        B: tl.constexpr, N: tl.constexpr, K: tl.constexpr, G: tl.constexpr,
        G_PAD: tl.constexpr, H: tl.constexpr, P: tl.constexpr, M: tl.constexpr,
        PAGE: tl.constexpr, PPB: tl.constexpr, SPLITS: tl.constexpr, IEEE: tl.constexpr):
    pid = tl.program_id(0)
    s = pid % SPLITS
    bk = pid // SPLITS
    kh = bk % K
    b = bk // K
    seq_len = tl.minimum(tl.load(lens_ptr + b), M * PAGE)                # never past the table
    layer = tl.load(layer_ptr)
    BLOCK_N: tl.constexpr = PPB * PAGE
    if WINDOW > 0:
        lo = tl.maximum(seq_len - WINDOW, 0)
    else:
        lo = 0
    first_page = lo // PAGE
    n_pages = (seq_len + PAGE - 1) // PAGE
    n_blocks = (tl.maximum(n_pages - first_page, 0) + PPB - 1) // PPB
    per_split = (n_blocks + SPLITS - 1) // SPLITS
    blk_lo = tl.minimum(s * per_split, n_blocks)
    blk_hi = tl.minimum(blk_lo + per_split, n_blocks)
    offs_g = tl.arange(0, G_PAD)
    offs_h = tl.arange(0, H)
    offs_n = tl.arange(0, BLOCK_N)
    g_ok = offs_g < G
    head = b * N + kh * G + offs_g                                        # query-head rows
    q = tl.load(q_ptr + head[:, None] * H + offs_h[None, :], mask=g_ok[:, None], other=0.0)
    # Pool row of (layer, page, kh, slot): ((layer * P + page) * K + kh) * PAGE + slot, int64.
    kv_base = layer.to(tl.int64) * P * K * PAGE * H + kh * PAGE * H
    slot = offs_n % PAGE
    m_i = tl.full([G_PAD], -1e30, tl.float32)                           # = NEG_INIT
    l_i = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, H], tl.float32)
    lp = first_page + blk_lo * PPB + offs_n // PAGE                       # logical page per key
    page = tl.load(bt_ptr + b * M + lp, mask=lp < n_pages, other=0)
    for blk in range(blk_lo, blk_hi):
        pos = lp * PAGE + slot
        valid = (pos < seq_len) & (pos >= lo)
        lp_next = lp + PPB
        page_next = tl.load(bt_ptr + b * M + lp_next, mask=lp_next < n_pages, other=0)
        rows = kv_base + page.to(tl.int64) * (K * PAGE * H) + slot * H
        ptrs = rows[:, None] + offs_h[None, :]
        k = tl.load(k_ptr + ptrs, mask=valid[:, None], other=0.0)
        x = _dot(q, tl.trans(k), IEEE)
        if SOFT_CAP > 0:  # tanh(y) = 1 - 2 / (exp(2y) + 1), in log2 units after the cap
            x = x * QK_SCALE / SOFT_CAP
            x = (SOFT_CAP * 1.4426950408889634) * (1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0))
        else:
            x = x * QK_SCALE
        x = tl.where(valid[None, :], x, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(x, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(x - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + ptrs, mask=valid[:, None], other=0.0)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, IEEE)
        m_i = m_new
        lp = lp_next
        page = page_next
    if SPLITS == 1:
        out = tl.where(l_i[:, None] > 0, acc / tl.where(l_i > 0, l_i, 1.0)[:, None], 0.0)
        tl.store(o_ptr + head[:, None] * H + offs_h[None, :], out.to(o_ptr.dtype.element_ty),
                 mask=g_ok[:, None])
    else:  # partials [SPLITS, B, N(, H)], every real row written (empty split: NEG_INIT, 0, 0)
        row = s * (B * N) + head
        tl.store(o_ptr + row[:, None] * H + offs_h[None, :], acc, mask=g_ok[:, None])
        tl.store(m_ptr + row, m_i, mask=g_ok)
        tl.store(l_ptr + row, l_i, mask=g_ok)


@functools.partial(jax.jit, static_argnames=(
    "scale", "soft_cap", "sliding_window", "pages_per_block", "num_warps", "num_stages",
    "k_splits"))
def _paged_decode(q, k_pool, v_pool, block_tables, seq_lens, layer, *, scale, soft_cap,
                  sliding_window, pages_per_block, num_warps, num_stages, k_splits):
    import jax_triton as jt
    B, N, H = q.shape
    L, P, K, page_size, _ = k_pool.shape
    G = N // K
    G_PAD = padded_group(G)
    layer_arr = jnp.asarray(layer, jnp.int32).reshape(1)
    # QK_SCALE folds log2(e) in unless the soft cap (applied in natural units) needs it out.
    qk_scale = float(scale) if soft_cap is not None else float(scale) * LOG2E
    if k_splits == 1:
        out_shape = [jax.ShapeDtypeStruct((B, N, H), q.dtype),
                     jax.ShapeDtypeStruct((1,), jnp.float32),
                     jax.ShapeDtypeStruct((1,), jnp.float32)]
    else:
        out_shape = [jax.ShapeDtypeStruct((k_splits, B, N, H), jnp.float32),
                     jax.ShapeDtypeStruct((k_splits, B, N), jnp.float32),
                     jax.ShapeDtypeStruct((k_splits, B, N), jnp.float32)]
    o, m, l = jt.triton_call(
        q, k_pool, v_pool, block_tables, seq_lens, layer_arr,
        kernel=_paged_decode_kernel, out_shape=out_shape, grid=(B * K * k_splits,),
        num_warps=num_warps, num_stages=num_stages,
        QK_SCALE=qk_scale, SOFT_CAP=float(soft_cap) if soft_cap is not None else 0.0,
        WINDOW=int(sliding_window) if sliding_window is not None else 0,
        B=B, N=N, K=K, G=G, G_PAD=G_PAD, H=H, P=P, M=block_tables.shape[1], PAGE=page_size,
        PPB=pages_per_block, SPLITS=k_splits, IEEE=bool(k_pool.dtype == jnp.float32))
    if k_splits == 1:
        return o
    return combine_splits(o, m, l).astype(q.dtype)


def paged_decode_attention(
        q: jax.Array, k_pool: jax.Array, v_pool: jax.Array, block_tables: jax.Array,
        seq_lens: jax.Array, *, layer=0, scale: float, soft_cap: float | None = None,
        sliding_window: int | None = None, interpret: bool = False,
        pages_per_block: int | None = None, num_warps: int | None = None,
        num_stages: int | None = None, k_splits: int | None = None) -> jax.Array:
    """`triton_pallas.paged_decode_attention`'s contract via ``jax_triton.triton_call`` (knobs:
    `tuning.resolve("jax_triton", ...)`); q and pools share a dtype (bf16/f16/f32). ValueError:
    bad shapes/dtypes/knobs, ``interpret=True`` (CUDA only); ImportError: no triton/jax_triton."""
    if interpret:
        raise ValueError("interpret=True is not supported by the jax_triton variant: a Triton "
                         "kernel needs a CUDA GPU (use the 'triton' Pallas variant on the CPU)")
    B, N, H, K, page_size, M = check_decode_args(q, k_pool, v_pool, block_tables, seq_lens,
                                                 sliding_window, soft_cap)
    if q.dtype != k_pool.dtype:
        raise ValueError(f"q dtype {q.dtype} must equal the pools' dtype {k_pool.dtype}")
    knobs = tuning.resolve("jax_triton", B=B, K=K, G=N // K, M=M, page_size=page_size,
                           head_dim=H, dtype=k_pool.dtype, interpret=False,
                           pages_per_block=pages_per_block, num_warps=num_warps,
                           num_stages=num_stages, k_splits=k_splits)
    check_knobs(page_size=page_size, **knobs)
    return _paged_decode(q, k_pool, v_pool, block_tables, seq_lens, layer, scale=float(scale),
                         soft_cap=soft_cap, sliding_window=sliding_window, **knobs)
