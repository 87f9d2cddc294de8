"""Paged decode attention, Pallas with the Triton lowering (variant ``triton``). One program per
(row b, KV head k, split s): k's G query heads as a ``[G_PAD, H]`` tile (G_PAD a power of 2 >= 16),
``pages_per_block`` pages a step, online softmax in f32, splits merged by `combine_splits`. fp8
pages: cast to q's dtype, K scale in the logit scale, V scale in the output. Sources:
flash-decoding; PagedAttention; JAX's pallas.ops.gpu.paged_attention."""

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.kv_quant import check_scales
from pallas_kernels.paged_attention import reference, tuning
from pallas_kernels.sizes import is_pow2, next_pow2, raise_first

LOG2E = math.log2(math.e)
MIN_MMA_ROWS = 16
NEG_INIT = -1e30  # finite "-inf" running max: exp2(m_old - m_new) stays finite for empty splits
HIGHEST = lax.Precision.HIGHEST  # IEEE f32 MMA for f32 inputs (Triton maps DEFAULT to tf32)
NT_DIMS, NN_DIMS = (((1,), (1,)), ((), ())), (((1,), (0,)), ((), ()))  # a @ b.T, a @ b


def check_decode_args(
    q, k_pool, v_pool, block_tables, seq_lens, sliding_window=None, soft_cap=None, ndim: int = 3
) -> tuple[int, int, int, int, int, int]:
    """`reference.check_args` plus int32 tables and lengths, powers of 2 for the Triton kernels."""
    B, N, H, K, page_size, M = reference.check_args(
        q, k_pool, v_pool, block_tables, seq_lens, sliding_window, soft_cap, ndim
    )
    raise_first(
        [
            (
                K < 1 or N % max(K, 1),
                f"q heads N={N} must be a positive multiple of KV heads K={K}",
            ),
            (
                block_tables.dtype != jnp.int32,
                f"block_tables dtype must be int32; got {block_tables.dtype}",
            ),
            (seq_lens.dtype != jnp.int32, f"seq_lens dtype must be int32; got {seq_lens.dtype}"),
            (
                not is_pow2(page_size),
                f"page_size={page_size} must be a power of 2 for the Triton kernels",
            ),
            (
                not (is_pow2(H) and H >= 16),
                f"head dim H={H} must be a power of 2 >= 16 for the Triton kernels",
            ),
        ]
    )
    return B, N, H, K, page_size, M


def check_knobs(
    pages_per_block: int, k_splits: int, num_warps: int, num_stages: int, page_size: int
) -> None:
    """Validate tuning knobs. Raises ValueError naming the knob."""
    raise_first(
        [
            (
                not is_pow2(pages_per_block),
                f"pages_per_block={pages_per_block} must be a power of 2",
            ),
            (
                pages_per_block * page_size < 16,
                f"pages_per_block * page_size = "
                f"{pages_per_block * page_size} must be >= 16 (MMA minimum)",
            ),
            (k_splits < 1, f"k_splits={k_splits} must be >= 1"),
            (
                num_warps not in (1, 2, 4, 8, 16),
                f"num_warps={num_warps} must be one of 1, 2, 4, 8, 16",
            ),
            (num_stages < 1, f"num_stages={num_stages} must be >= 1"),
        ]
    )


def layer_scales(k_scale, v_scale, layer, L: int, K: int) -> tuple[jax.Array, jax.Array]:
    """The K and V scales f32[K] of ``layer`` (``[layer]`` of f32[L, K]; None: ones)."""
    return tuple(
        jnp.ones((K,), jnp.float32)
        if s is None
        else jnp.asarray(s, jnp.float32).reshape(L, K)[layer]
        for s in (k_scale, v_scale)
    )


def normalize(acc, l):
    """acc / l per row; zeros for rows with no key (l == 0)."""
    return jnp.where(l[..., None] > 0, acc / jnp.where(l > 0, l, 1.0)[..., None], 0.0)


def combine_splits(acc: jax.Array, m: jax.Array, l: jax.Array) -> jax.Array:
    """Merge flash-decoding partials -> f32[..., H] (zeros if all empty). acc: f32[S, ..., H]
    un-normalised (sum_j 2^(x_j - m_s) v_j); m: f32[S, ...] running max, log2 (NEG_INIT: none)."""
    w = jnp.exp2(m - jnp.max(m, axis=0)[None])
    return normalize(jnp.sum(w[..., None] * acc, axis=0), jnp.sum(w * l, axis=0))


def online_softmax_step(q, k, v, valid, carry, *, qk_scale, soft_cap):
    """Online-softmax step over one key block (log2 units): q [R, H], k, v [BLOCK_N, H] (q's dtype
    or fp8), ``valid`` bool broadcastable to [R, BLOCK_N]; carry (acc f32[R, H], m, l f32[R])."""
    acc, m_i, l_i = carry
    k, v = k.astype(q.dtype), v.astype(q.dtype)  # fp8 pages: exact
    x = (
        lax.dot_general(q, k, NT_DIMS, precision=HIGHEST, preferred_element_type=jnp.float32)
        * qk_scale
    )  # [R, BLOCK_N]
    if soft_cap is not None:
        x = (soft_cap * LOG2E) * jnp.tanh(x / soft_cap)
    x = jnp.where(valid, x, -jnp.inf)
    m_new = jnp.maximum(m_i, jnp.max(x, axis=1))
    alpha, p = jnp.exp2(m_i - m_new), jnp.exp2(x - m_new[:, None])
    l_new = l_i * alpha + jnp.sum(p, axis=1)
    acc = acc * alpha[:, None] + lax.dot_general(
        p.astype(v.dtype), v, NN_DIMS, precision=HIGHEST, preferred_element_type=jnp.float32
    )
    return acc, m_new, l_new


def full_block(shape):
    """A BlockSpec of the whole array (every program sees all of it)."""
    return pl.BlockSpec(shape, lambda *_: (0,) * len(shape))


def logit_scale(scale: float, soft_cap: float | None) -> float:
    """The static factor of the logits before a key scale: ``scale``, times LOG2E (log2 units)
    unless soft-capped (the cap converts after the tanh)."""
    return scale if soft_cap is not None else scale * LOG2E


def block_slots(page_size: int, pages_per_block: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """A key block's offsets i32[BLOCK_N] (BLOCK_N = pages_per_block * page_size) and each key's
    page within the block and slot within its page, i32[BLOCK_N] each."""
    offs = jnp.arange(pages_per_block * page_size, dtype=jnp.int32)
    return offs, offs // page_size, offs % page_size


def init_state(R: int, H: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The empty online-softmax carry of R query rows: acc f32[R, H] zeros, m f32[R] NEG_INIT,
    l f32[R] zeros."""
    return (
        jnp.zeros((R, H), jnp.float32),
        jnp.full((R,), NEG_INIT, jnp.float32),
        jnp.zeros((R,), jnp.float32),
    )


def _split_blocks(seq_len, s, *, page_size, pages_per_block, k_splits, sliding_window):
    """Split s's key blocks. Visible positions are [lo, seq_len) (i32 scalars); their pages, from
    ``first_page`` on, go in blocks of pages_per_block, and split s takes blocks [blk_lo, blk_hi)
    of k_splits equal runs (empty past the end). -> (lo, first_page, blk_lo, blk_hi), i32."""
    lo = jnp.int32(0) if sliding_window is None else jnp.maximum(seq_len - sliding_window, 0)
    first_page, n_pages = lo // page_size, (seq_len + page_size - 1) // page_size
    n_blocks = (jnp.maximum(n_pages - first_page, 0) + pages_per_block - 1) // pages_per_block
    per_split = (n_blocks + k_splits - 1) // k_splits
    blk_lo = jnp.minimum(s * per_split, n_blocks)
    blk_hi = jnp.minimum(blk_lo + per_split, n_blocks)
    return lo, first_page, blk_lo, blk_hi


def _store_decode(out_refs, acc, m_i, l_i):
    """Write one program's result: with one output ref, normalised acc [G_PAD, H] in its dtype;
    with three (k_splits > 1), the partials acc f32[G_PAD, H], m, l f32[G_PAD]."""
    if len(out_refs) == 1:
        out_refs[0][...] = normalize(acc, l_i).astype(out_refs[0].dtype)
    else:  # the partials
        for ref, x in zip(out_refs, (acc, m_i, l_i)):
            ref[...] = x


def _kernel(
    layer_ref,
    lens_ref,
    bt_ref,
    ks_ref,
    vs_ref,
    q_ref,
    k_ref,
    v_ref,
    *out_refs,
    G_PAD,
    H,
    M,
    page_size,
    pages_per_block,
    k_splits,
    scale,
    soft_cap,
    sliding_window,
):
    b, kh, s = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    layer = layer_ref[0]
    seq_len = jnp.minimum(lens_ref[b], M * page_size)  # never past the table
    lo, first_page, blk_lo, blk_hi = _split_blocks(
        seq_len,
        s,
        page_size=page_size,
        pages_per_block=pages_per_block,
        k_splits=k_splits,
        sliding_window=sliding_window,
    )
    q = q_ref[...]  # [G_PAD, H]
    qk_scale = logit_scale(scale, soft_cap) * ks_ref[kh]
    offs, tok_page, slot = block_slots(page_size, pages_per_block)

    def body(blk, carry):
        *state, pages = carry
        p0 = first_page + blk * pages_per_block
        pages_next = bt_ref[b, p0 + pages_per_block + tok_page]  # one block ahead
        pos = p0 * page_size + offs
        valid = ((pos < seq_len) & (pos >= lo))[None, :]
        state = online_softmax_step(
            q,
            k_ref[layer, pages, kh, slot],
            v_ref[layer, pages, kh, slot],
            valid,
            state,
            qk_scale=qk_scale,
            soft_cap=soft_cap,
        )
        return (*state, pages_next)

    pages0 = bt_ref[b, first_page + blk_lo * pages_per_block + tok_page]
    init = (*init_state(G_PAD, H), pages0)
    acc, m_i, l_i, _ = lax.fori_loop(blk_lo, blk_hi, body, init)
    _store_decode(out_refs, acc * vs_ref[kh], m_i, l_i)


def _decode_specs(qg, bt, pool, k_splits: int):
    """`_kernel`'s BlockSpecs on grid (B, K, k_splits) -> (in_specs, out_shape, out_specs), from
    the arrays it gets: qg [B, K, G_PAD, H] grouped queries (one [G_PAD, H] tile a program), bt
    i32[B, M + 2 * pages_per_block] padded tables, pool either pool (whole), plus layer i32[1],
    seq_lens i32[B], K and V scales f32[K] (whole). Output: [B, K, G_PAD, H] in qg's dtype if
    k_splits == 1, else the partials acc f32[S, B, K, G_PAD, H], m and l f32[S, B, K, G_PAD]
    (S = k_splits)."""
    B, K, G_PAD, H = qg.shape
    q_spec = pl.BlockSpec((None, None, G_PAD, H), lambda b, k, s: (b, k, 0, 0))
    in_specs = [
        full_block((1,)),
        full_block((B,)),
        full_block(bt.shape),
        full_block((K,)),
        full_block((K,)),
        q_spec,
        full_block(pool.shape),
        full_block(pool.shape),
    ]
    if k_splits == 1:
        out_shape, out_specs = [jax.ShapeDtypeStruct(qg.shape, qg.dtype)], [q_spec]
    else:  # partials acc [S, B, K, G_PAD, H], m and l [S, B, K, G_PAD]
        tails = ((G_PAD, H), (G_PAD,), (G_PAD,))
        out_shape = [jax.ShapeDtypeStruct((k_splits, B, K, *t), jnp.float32) for t in tails]
        out_specs = [
            pl.BlockSpec((None, None, None, *t), lambda b, k, s, n=len(t): (s, b, k) + (0,) * n)  # noqa: B008
            for t in tails
        ]
    return in_specs, out_shape, out_specs


@functools.partial(
    jax.jit,
    static_argnames=(
        "scale",
        "soft_cap",
        "sliding_window",
        "interpret",
        "pages_per_block",
        "num_warps",
        "num_stages",
        "k_splits",
    ),
)
def _paged_decode(
    q,
    k_pool,
    v_pool,
    block_tables,
    seq_lens,
    layer,
    k_scale,
    v_scale,
    *,
    scale,
    soft_cap,
    sliding_window,
    interpret,
    pages_per_block,
    num_warps,
    num_stages,
    k_splits,
):
    (B, N, H), (L, _, K, page_size, _) = q.shape, k_pool.shape
    G, M = N // K, block_tables.shape[1]
    G_PAD = max(MIN_MMA_ROWS, next_pow2(G))
    # Pad (null page 0) so every block and the prefetched next one are in range.
    bt = jnp.pad(block_tables, ((0, 0), (0, 2 * pages_per_block)))
    scales = layer_scales(k_scale, v_scale, layer, L, K)
    qg = jnp.pad(q.reshape(B, K, G, H), ((0, 0), (0, 0), (0, G_PAD - G), (0, 0)))
    kernel = functools.partial(
        _kernel,
        G_PAD=G_PAD,
        H=H,
        M=M,
        page_size=page_size,
        pages_per_block=pages_per_block,
        k_splits=k_splits,
        scale=float(scale),
        soft_cap=None if soft_cap is None else float(soft_cap),
        sliding_window=sliding_window,
    )
    in_specs, out_shape, out_specs = _decode_specs(qg, bt, k_pool, k_splits)
    outs = pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=(B, K, k_splits),
        in_specs=in_specs,
        out_specs=out_specs,
        interpret=interpret,
        name=f"paged_decode_triton_ppb{pages_per_block}_s{k_splits}",
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
    )(jnp.asarray(layer, jnp.int32).reshape(1), seq_lens, bt, *scales, qg, k_pool, v_pool)
    o = outs[0] if k_splits == 1 else combine_splits(*outs)
    return o[:, :, :G].reshape(B, N, H).astype(q.dtype)


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
    pages_per_block: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    k_splits: int | None = None,
    k_scale: jax.Array | None = None,
    v_scale: jax.Array | None = None,
) -> jax.Array:
    """`reference.paged_decode_attention` in Pallas/Triton. q bf16/f16/f32; pools q's dtype or fp8
    (k_scale, v_scale f32[L, K]); page_size, H powers of 2 (visible slots past seq_len: finite);
    knobs None: `tuning.resolve`. ValueError: `check_decode_args`, `check_knobs`, `check_scales`."""
    B, N, H, K, page_size, M = check_decode_args(
        q, k_pool, v_pool, block_tables, seq_lens, sliding_window, soft_cap
    )
    knobs = tuning.resolve(
        "triton",
        B=B,
        K=K,
        G=N // K,
        M=M,
        page_size=page_size,
        head_dim=H,
        dtype=k_pool.dtype,
        interpret=interpret,
        pages_per_block=pages_per_block,
        num_warps=num_warps,
        num_stages=num_stages,
        k_splits=k_splits,
    )
    check_knobs(page_size=page_size, **knobs)
    check_scales(k_pool, k_scale, v_scale)
    return _paged_decode(
        q,
        k_pool,
        v_pool,
        block_tables,
        seq_lens,
        layer,
        k_scale,
        v_scale,
        scale=float(scale),
        soft_cap=soft_cap,
        sliding_window=sliding_window,
        interpret=bool(interpret),
        **knobs,
    )
