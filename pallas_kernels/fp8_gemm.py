"""fp8-weight GEMM of decode (few rows): ``y = (x @ w) * scale`` with the float8_e4m3fn weight
read once from HBM (half the bytes of bf16) and converted to bf16 in registers, so no bf16 copy of
the weight is written or read. Pallas with the Triton lowering: one program per (N block n, K
split s) loops over split s's K range in ``block_k`` chunks, a ``[M_PAD, block_k]`` bf16 tile of x
(rows zero-padded to M_PAD >= 16, the MMA minimum) times the ``[block_k, block_n]`` weight tile,
f32 accumulation. ``split_k == 1``: the scale applied in the epilogue, bf16 out; ``split_k > 1``:
f32 partials ``[S, M_PAD, N]`` summed by one XLA fusion, then scaled. Sources: split-K GEMM
(CUTLASS), Triton's matmul tutorial, weight-only-quantised GEMMs (vLLM's Marlin, w8a16)."""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.sizes import is_pow2, next_pow2, raise_first

MIN_MMA_ROWS = 16
DECODE_MAX_ROWS = 64   # `jaxinfer.models.layers.dense` calls the kernel up to this many rows
TARGET_PROGRAMS = 264  # default split_k: grid of >= 2 programs per SM of a 132-SM H100/H200
NN_DIMS = (((1,), (0,)), ((), ()))  # a @ b
FP8 = jnp.float8_e4m3fn


def fp8_matmul_reference(x: jax.Array, w: jax.Array, scale: jax.Array) -> jax.Array:
    """Float32 reference of `fp8_matmul`: x [M, K] (any float), w [K, N] float8_e4m3fn, scale
    f32[N] -> f32[M, N] ``= (x.astype(f32) @ w.astype(f32)) * scale`` at HIGHEST precision."""
    y = jnp.dot(x.astype(jnp.float32), w.astype(jnp.float32), precision=lax.Precision.HIGHEST)
    return y * scale.astype(jnp.float32)[None, :]


def default_knobs(M: int, K: int, N: int) -> dict:
    """Untuned knobs for x [M, K] @ w [K, N]: block_n the largest power of 2 <= 128 dividing N;
    block_k <= 256 dividing K, smaller for more rows (the x tile is [M_PAD, block_k]); split_k
    doubled while the grid has < `TARGET_PROGRAMS` programs, each split keeps >= 2 chunks and the
    f32 partials' traffic (write + read, 8 * S * M_PAD * N bytes) stays <= 1/4 of the weight's."""
    m_pad = max(MIN_MMA_ROWS, next_pow2(M))
    block_n = next(b for b in (128, 64, 32, 16, 1) if N % b == 0 or b == 1)
    block_k = next(b for b in (256, 128, 64, 32, 16, 1)
                   if (b <= max(32, 8192 // m_pad) and K % b == 0) or b == 1)
    split_k = 1
    while ((N // block_n) * split_k < TARGET_PROGRAMS and K % (2 * split_k * block_k) == 0
           and K // (2 * split_k * block_k) >= 2 and 2 * split_k * m_pad * 32 <= K):
        split_k *= 2
    return dict(block_n=block_n, block_k=block_k, split_k=split_k, num_warps=4, num_stages=3)


def check_args(x, w, scale, *, block_n: int, block_k: int, split_k: int, num_warps: int,
               num_stages: int) -> tuple[int, int, int]:
    """Validate `fp8_matmul`'s arguments -> (M, K, N). ValueError naming the argument: x not
    bf16[M, K], w not float8_e4m3fn[K, N], scale not f32[N]; block_n, block_k not powers of 2 >=
    16; N % block_n, K % (split_k * block_k) not 0; split_k < 1; num_warps, num_stages bad."""
    raise_first([
        (x.ndim != 2 or x.dtype != jnp.bfloat16, f"x must be bfloat16 [M, K]; got {x.dtype}"
         f"{list(x.shape)}"),
        (w.ndim != 2 or w.dtype != FP8, f"w must be float8_e4m3fn [K, N]; got {w.dtype}"
         f"{list(w.shape)}"),
        (x.shape[-1] != w.shape[0], f"x [M, K]={list(x.shape)} and w [K, N]={list(w.shape)} "
         "disagree on K"),
        (scale.shape != w.shape[1:] or scale.dtype != jnp.float32,
         f"scale must be float32 [N={w.shape[-1]}]; got {scale.dtype}{list(scale.shape)}")])
    (M, K), N = x.shape, w.shape[1]
    raise_first([
        (not (is_pow2(block_n) and block_n >= 16), f"block_n={block_n} must be a power of 2 "
         ">= 16 (MMA minimum)"),
        (not (is_pow2(block_k) and block_k >= 16), f"block_k={block_k} must be a power of 2 "
         ">= 16 (MMA minimum)"),
        (not (isinstance(split_k, int) and split_k >= 1), f"split_k={split_k} must be >= 1"),
        (M < 1, f"x must have at least one row; got M={M}"),
        (N % block_n, f"N={N} must be a multiple of block_n={block_n}"),
        (K % max(1, split_k * block_k), f"K={K} must be a multiple of split_k * block_k = "
         f"{split_k} * {block_k}"),
        (num_warps not in (1, 2, 4, 8, 16), f"num_warps={num_warps} must be one of 1, 2, 4, 8, "
         "16"),
        (num_stages < 1, f"num_stages={num_stages} must be >= 1")])
    return M, K, N


def _kernel(x_ref, w_ref, s_ref, o_ref, *, block_k: int, n_chunks: int, split_k: int):
    """Program (n, s): x_ref bf16[M_PAD, K/S], w_ref fp8[K/S, block_n], s_ref f32[block_n] ->
    o_ref bf16[M_PAD, block_n] (scaled; split_k == 1) or f32 partial sums (split_k > 1)."""
    def body(i, acc):
        k0 = pl.multiple_of(i * block_k, block_k)
        xt = x_ref[:, pl.ds(k0, block_k)]                                 # [M_PAD, block_k] bf16
        wt = w_ref[pl.ds(k0, block_k), :].astype(xt.dtype)               # e4m3 -> bf16: exact
        return acc + lax.dot_general(xt, wt, NN_DIMS, preferred_element_type=jnp.float32)

    acc = lax.fori_loop(0, n_chunks, body, jnp.zeros(o_ref.shape, jnp.float32))
    if split_k == 1:
        o_ref[...] = (acc * s_ref[...][None, :]).astype(o_ref.dtype)
    else:
        o_ref[...] = acc


@functools.partial(jax.jit, static_argnames=(
    "block_n", "block_k", "split_k", "num_warps", "num_stages", "interpret"))
def _fp8_matmul(x, w, scale, *, block_n, block_k, split_k, num_warps, num_stages, interpret):
    (M, K), N = x.shape, w.shape[1]
    m_pad, ks = max(MIN_MMA_ROWS, next_pow2(M)), K // split_k
    xp = jnp.pad(x, ((0, m_pad - M), (0, 0))) if m_pad != M else x
    kernel = functools.partial(_kernel, block_k=block_k, n_chunks=ks // block_k, split_k=split_k)
    in_specs = [pl.BlockSpec((m_pad, ks), lambda n, s: (0, s)),
                pl.BlockSpec((ks, block_n), lambda n, s: (s, n)),
                pl.BlockSpec((block_n,), lambda n, s: (n,))]
    if split_k == 1:
        out_shape = jax.ShapeDtypeStruct((m_pad, N), x.dtype)
        out_spec = pl.BlockSpec((m_pad, block_n), lambda n, s: (0, n))
    else:
        out_shape = jax.ShapeDtypeStruct((split_k, m_pad, N), jnp.float32)
        out_spec = pl.BlockSpec((None, m_pad, block_n), lambda n, s: (s, 0, n))
    out = pl.pallas_call(
        kernel, out_shape=out_shape, grid=(N // block_n, split_k), in_specs=in_specs,
        out_specs=out_spec, interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        name=f"fp8_gemm_n{block_n}_k{block_k}_s{split_k}",
    )(xp, w, scale)
    if split_k > 1:
        out = (out.sum(axis=0) * scale[None, :]).astype(x.dtype)
    return out[:M]


def fp8_matmul(x: jax.Array, w: jax.Array, scale: jax.Array, *, block_n: int | None = None,
               block_k: int | None = None, split_k: int | None = None,
               num_warps: int | None = None, num_stages: int | None = None,
               interpret: bool = False) -> jax.Array:
    """x bf16[M, K] @ w float8_e4m3fn[K, N] with per-output-channel scale f32[N] -> bf16[M, N]
    ``= ((x @ w.astype(f32)) * scale).astype(bf16)``: bf16 x bf16 products (e4m3 is exact in
    bf16), f32 accumulation, one bf16 rounding of the scaled sum. Knobs left None:
    `default_knobs`. The grid is (N / block_n, split_k); decode rows (M <= `DECODE_MAX_ROWS`)
    are its use (the x tile and the accumulator hold all M_PAD rows). ValueError: `check_args`."""
    knobs = dict(block_n=block_n, block_k=block_k, split_k=split_k, num_warps=num_warps,
                 num_stages=num_stages)
    if x.ndim == 2 and w.ndim == 2:
        defaults = default_knobs(x.shape[0], x.shape[1], w.shape[1])
        knobs = {k: defaults[k] if v is None else v for k, v in knobs.items()}
    check_args(x, w, scale, **knobs)
    return _fp8_matmul(x, w, scale, interpret=bool(interpret), **knobs)
