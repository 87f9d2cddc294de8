"""The attention prologue (q/k RMSNorm + RoPE + K/V page write) as one Pallas/Triton kernel,
`reference.qkv_prologue`'s contract. Grids (``grid``): "head", one program per (token, query row or
key or value head); "group", one per (token, KV group of query heads), plus one for the keys and one
for the values. The pools alias the outputs. Sources: as `reference.py`."""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.kv_quant import check_scales, quantize
from pallas_kernels.paged_attention.triton_pallas import full_block as full
from pallas_kernels.paged_attention.triton_pallas import layer_scales
from pallas_kernels.qkv_prologue import reference
from pallas_kernels.qkv_prologue.reference import check_args
from pallas_kernels.sizes import is_pow2


def _program(slots_ref, layer_ref, H: int, page_size: int):
    """(s, j, lo, hi, page, off, layer): grid indices, the RoPE halves' slices, the K/V slot."""
    s, j, half = pl.program_id(0), pl.program_id(1), H // 2
    slot = slots_ref[s]
    return (s, j, pl.ds(0, half), pl.ds(half, half), slot // page_size, slot % page_size,
            layer_ref[0])


def _per_head_kernel(layer_ref, slots_ref, cos_ref, sin_ref, wq_ref, wk_ref, qkv_ref, k_in, v_in,
                     ks_ref, vs_ref, q_ref, k_ref, v_ref, *, N, K, G, Gq, H, page_size, eps,
                     has_norm):
    """Grid "head", (token s, j): query row j % Gq of group j // Gq (j < K * Gq), keys, values."""
    del k_in, v_in  # aliased to k_ref, v_ref
    s, j, lo, hi, page, off, layer = _program(slots_ref, layer_ref, H, page_size)
    nq = K * Gq
    g, r = j // Gq, j % Gq
    half, dt = H // 2, q_ref.dtype

    def norm_rope(head, w_ref):
        x1, x2 = qkv_ref[s, head, lo], qkv_ref[s, head, hi]
        if has_norm:
            x1, x2 = _rms_norm_halves(x1, x2, w_ref[lo], w_ref[hi], H, eps, dt, axis=None)
        return _rope_halves(x1, x2, cos_ref[s, :], sin_ref[s, :])

    @pl.when((j < nq) & (r < G))
    def _query():
        o1, o2 = norm_rope(g * G + r, wq_ref)
        q_ref[s, g, r, lo] = o1.astype(dt)
        q_ref[s, g, r, hi] = o2.astype(dt)

    if Gq > G:
        @pl.when((j < nq) & (r >= G))
        def _zero_row():
            q_ref[s, g, r, lo] = jnp.zeros((half,), dt)
            q_ref[s, g, r, hi] = jnp.zeros((half,), dt)

    @pl.when((j >= nq) & (j < nq + K))
    def _key():
        kh = j - nq
        o1, o2 = norm_rope(N + kh, wk_ref)
        k_ref[layer, page, kh, off, lo] = quantize(o1.astype(dt), ks_ref[kh], k_ref.dtype)
        k_ref[layer, page, kh, off, hi] = quantize(o2.astype(dt), ks_ref[kh], k_ref.dtype)

    @pl.when(j >= nq + K)
    def _value():
        kh = j - nq - K
        v_ref[layer, page, kh, off, :] = quantize(qkv_ref[s, N + K + kh, :], vs_ref[kh],
                                                  v_ref.dtype)


def _grouped_kernel(layer_ref, slots_ref, cos_ref, sin_ref, wq_ref, wk_ref, qkv_ref, k_in, v_in,
                    ks_ref, vs_ref, q_ref, k_ref, v_ref, *, N, K, G, Gq, H, page_size, eps,
                    has_norm):
    """Grid "group", (token s, j): j < K the G query heads of KV group j (as Gq rows, zero past
    G), j = K all K key heads, j = K + 1 all K values. K, Gq powers of 2 (Triton block shapes)."""
    del k_in, v_in  # aliased to k_ref, v_ref
    s, j, lo, hi, page, off, layer = _program(slots_ref, layer_ref, H, page_size)
    half, dt = H // 2, q_ref.dtype

    def norm_rope(x1, x2, w_ref):
        if has_norm:
            x1, x2 = _rms_norm_halves(x1, x2, w_ref[lo][None, :], w_ref[hi][None, :], H, eps, dt,
                                      axis=1)
        return _rope_halves(x1, x2, cos_ref[s, :][None, :], sin_ref[s, :][None, :])

    @pl.when(j < K)
    def _queries():
        rows = pl.ds(j * G, Gq)
        if Gq == G:
            x1, x2 = qkv_ref[s, rows, lo], qkv_ref[s, rows, hi]
        else:  # rows past G belong to the next group (or past the array): masked, then zeroed
            valid = jax.lax.broadcasted_iota(jnp.int32, (Gq, half), 0) < G
            x1 = plgpu.load(qkv_ref.at[s, rows, lo], mask=valid, other=0)
            x2 = plgpu.load(qkv_ref.at[s, rows, hi], mask=valid, other=0)
        o1, o2 = norm_rope(x1, x2, wq_ref)
        if Gq != G:
            o1, o2 = jnp.where(valid, o1, 0.0), jnp.where(valid, o2, 0.0)
        q_ref[s, j, :, lo] = o1.astype(dt)
        q_ref[s, j, :, hi] = o2.astype(dt)

    @pl.when(j == K)
    def _keys():
        rows = pl.ds(N, K)
        o1, o2 = norm_rope(qkv_ref[s, rows, lo], qkv_ref[s, rows, hi], wk_ref)
        ks = ks_ref[...][:, None]                                         # [K, 1]
        k_ref[layer, page, :, off, lo] = quantize(o1.astype(dt), ks, k_ref.dtype)
        k_ref[layer, page, :, off, hi] = quantize(o2.astype(dt), ks, k_ref.dtype)

    @pl.when(j == K + 1)
    def _values():
        v_ref[layer, page, :, off, :] = quantize(qkv_ref[s, pl.ds(N + K, K), :],
                                                 vs_ref[...][:, None], v_ref.dtype)


def _rms_norm_halves(x1, x2, w1, w2, H, eps, dt, axis):
    """RMSNorm of heads as two halves, HF rounding to ``dt``; ``axis`` None: a head, 1: rows."""
    f1, f2 = x1.astype(jnp.float32), x2.astype(jnp.float32)
    keep = axis is not None
    var = (jnp.sum(f1 * f1, axis=axis, keepdims=keep) + jnp.sum(f2 * f2, axis=axis,
                                                                 keepdims=keep)) / H
    r = jax.lax.rsqrt(var + eps)
    w1, w2 = w1.astype(dt).astype(jnp.float32), w2.astype(dt).astype(jnp.float32)
    x1 = ((f1 * r).astype(dt).astype(jnp.float32) * w1).astype(dt)
    x2 = ((f2 * r).astype(dt).astype(jnp.float32) * w2).astype(dt)
    return x1, x2


def _rope_halves(x1, x2, c, sn):
    f1, f2 = x1.astype(jnp.float32), x2.astype(jnp.float32)
    return f1 * c - f2 * sn, f2 * c + f1 * sn


@functools.partial(jax.jit, static_argnames=("N", "K", "Gq", "eps", "interpret", "num_warps",
                                             "grouped"))
def _prologue(qkv, wq, wk, cos, sin, slot_mapping, k_pool, v_pool, layer, k_scale, v_scale, *, N,
              K, Gq, eps, interpret, num_warps, grouped):
    S, (L, _, _, page_size, H), G = qkv.shape[0], k_pool.shape, N // K
    has_norm = wq is not None
    if wq is None:
        wq = wk = jnp.ones((H,), qkv.dtype)                  # unread
    rows = Gq or G
    common = dict(N=N, K=K, G=G, Gq=rows, H=H, page_size=page_size, eps=float(eps),
                  has_norm=has_norm)
    if grouped:
        kernel, grid = functools.partial(_grouped_kernel, **common), (S, K + 2)
    else:
        kernel, grid = functools.partial(_per_head_kernel, **common), (S, K * rows + 2 * K)
    q_shape = (S, K, rows, H)
    qkv3 = qkv.reshape(S, N + 2 * K, H)
    layer_arr = jnp.asarray(layer, jnp.int32).reshape(1)
    q, k_pool, v_pool = pl.pallas_call(
        kernel,
        out_shape=[jax.ShapeDtypeStruct(q_shape, qkv.dtype), jax.ShapeDtypeStruct(
            k_pool.shape, k_pool.dtype), jax.ShapeDtypeStruct(v_pool.shape, v_pool.dtype)],
        grid=grid,
        in_specs=[full((1,)), full((S,)), full((S, H // 2)), full((S, H // 2)), full((H,)),
                  full((H,)), full((S, N + 2 * K, H)), full(k_pool.shape), full(v_pool.shape),
                  full((K,)), full((K,))],
        out_specs=[full(q_shape), full(k_pool.shape), full(v_pool.shape)],
        input_output_aliases={7: 1, 8: 2},
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
        name="qkv_prologue",
    )(layer_arr, slot_mapping.astype(jnp.int32), cos.astype(jnp.float32),
      sin.astype(jnp.float32), wq, wk, qkv3, k_pool, v_pool,
      *layer_scales(k_scale, v_scale, layer, L, K))
    if Gq is None:
        q = q.reshape(S, N, H)
    return q, k_pool, v_pool


_ONE_WAVE_PROGRAMS = 4096   # about the one-warp programs a 132-SM Hopper GPU holds at once


def qkv_prologue(qkv: jax.Array, q_norm: jax.Array | None, k_norm: jax.Array | None,
                 cos: jax.Array, sin: jax.Array, slot_mapping: jax.Array, k_pool: jax.Array,
                 v_pool: jax.Array, *, layer, num_heads: int, num_kv_heads: int,
                 eps: float = 1e-6, q_group_rows: int | None = None, interpret: bool = False,
                 grid: str = "auto", num_warps: int | None = None,
                 k_scale: jax.Array | None = None, v_scale: jax.Array | None = None
                 ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`reference.qkv_prologue`'s contract in one Pallas launch (H/2 a power of 2; slots and layer
    out of range write out of bounds). grid: "group", S * (K + 2) programs (K and rows per group,
    ``q_group_rows`` or G, powers of 2); "head", S * (K * rows + 2K); "auto": "head" while that fits
    about one wave (4096; BENCHMARKS.md "Throughput"), else "group" where it applies. num_warps
    None: 1 for "head", 2 for "group". ValueError: `reference.check_args`, `kv_quant.check_scales`;
    H/2 not a power of 2; ``grid`` unknown, or "group" where it can't."""
    args = (qkv, q_norm, k_norm, cos, sin, slot_mapping, k_pool, v_pool)
    S, N, K, H = check_args(*args, num_heads, num_kv_heads, q_group_rows)
    check_scales(k_pool, k_scale, v_scale)
    if not is_pow2(H // 2):
        raise ValueError(f"head dim H={H}: H/2 must be a power of 2 for the Triton kernel")
    rows = q_group_rows or N // K
    groupable = is_pow2(K) and is_pow2(rows)
    if grid not in ("auto", "group", "head"):
        raise ValueError(f"grid={grid!r} is not one of ('auto', 'group', 'head')")
    if grid == "group" and not groupable:
        raise ValueError(f"grid='group' needs the KV heads K and the query rows per group to be "
                         f"powers of 2; got K={K}, rows={rows}; use 'head' or 'auto'")
    grouped = (groupable and S * (K * rows + 2 * K) > _ONE_WAVE_PROGRAMS if grid == "auto"
               else grid == "group")
    if S == 0:  # no tokens: nothing to write, no launch (a grid of 0 programs is not valid)
        return reference.qkv_prologue(*args, layer=layer, num_heads=N, num_kv_heads=K, eps=eps,
                                      q_group_rows=q_group_rows, k_scale=k_scale, v_scale=v_scale)
    return _prologue(*args, layer, k_scale, v_scale, N=N, K=K, Gq=q_group_rows, eps=float(eps),
                     interpret=bool(interpret),
                     num_warps=int((2 if grouped else 1) if num_warps is None else num_warps),
                     grouped=grouped)
