"""Few-row matrix product ``y = x @ w`` (decode at batch 1-4) as one Pallas kernel, Triton lowering.

What it replaces: at one row XLA runs a narrow projection (N of 4096-6144, K of 4096-12288) as a
split-K GEMM whose float32 partial sums a second launch adds up. Here program j owns the output
columns ``[j * bn, (j + 1) * bn)``: it streams its [K, bn] strip of ``w`` in [bk, bn] tiles
(software-pipelined, ``num_stages``), multiplies them with the M rows of ``x`` on the CUDA cores
(float32 products summed over the tile), and writes y in the output dtype: one launch.

Status: experimental, not used by the engine. Validated in interpret mode on the CPU against
`reference.gemv` (``tests/kernels/test_gemv.py``). On the H200 at one row it is 1.2-2.3x slower
than XLA's split-K GEMM + reduction for the Qwen3-8B projections (wo 19.1 vs 11.3 us, wqkv 24.5
vs 15.3, down 53.9 vs 26.7, gate_up 54.4 vs 46.6 at its best block sizes;
``scripts/bench_decode_gemm.py``, BENCHMARKS.md, ninth session): N / bn programs of one column
strip each do not keep enough loads in flight, and ``num_stages`` did not change the time (the
strip loop was not pipelined). ``splits`` > 1 splits K over more programs and returns float32
partial sums for a consumer kernel to add. At one row (tenth session) that form takes wo 10.8 us
(bn 64, bk 128, 16 splits) against XLA's 11.1 us for GEMM + sum, wqkv 14.9 against 15.5 (bn 128,
bk 64, 16 splits), down 28.2 against 26.3; but the add+norm kernel, one program per row, sums 16
partial rows in 5.0 us against 1.6 us for a bf16 delta, which eats the gain, so the engine still
does not use it.
"""

from __future__ import annotations

import functools
import operator

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.gemv.reference import check_args
from pallas_kernels.sizes import is_pow2

MAX_ROWS = 4  # rows are unrolled in the kernel: each keeps its own [bn] accumulator


def _kernel(x_ref, w_ref, o_ref, *, M, K, bk):
    bn = o_ref.shape[-1]

    def body(i, accs):
        k0 = pl.multiple_of(i * bk, bk)
        wt = w_ref[pl.ds(k0, bk), :].astype(jnp.float32)                  # [bk, bn]
        return tuple(a + jnp.sum(x_ref[m, pl.ds(k0, bk)].astype(jnp.float32)[:, None] * wt,
                                 axis=0) for m, a in enumerate(accs))

    accs = jax.lax.fori_loop(0, K // bk, body,
                             tuple(jnp.zeros((bn,), jnp.float32) for _ in range(M)))
    for m, a in enumerate(accs):
        o_ref[m, :] = a.astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("bn", "bk", "splits", "num_warps", "num_stages",
                                             "out_dtype", "interpret"))
def _gemv(x, w, *, bn, bk, splits, num_warps, num_stages, out_dtype, interpret):
    M, K = x.shape
    N = w.shape[1]
    Ks = K // splits                     # program (j, s) sums over rows [s * Ks, (s + 1) * Ks)
    out = pl.pallas_call(
        functools.partial(_kernel, M=M, K=Ks, bk=bk),
        out_shape=jax.ShapeDtypeStruct((splits, M, N), out_dtype),
        grid=(N // bn, splits),
        in_specs=[pl.BlockSpec((M, Ks), lambda j, s: (0, s)),
                  pl.BlockSpec((Ks, bn), lambda j, s: (s, j))],
        out_specs=pl.BlockSpec((None, M, bn), lambda j, s: (s, 0, j)),
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        name="gemv",
    )(x, w)
    return out[0] if splits == 1 else out


def _size_problem(M: int, K: int, N: int, bn: int, bk: int, splits: int) -> str | None:
    """What makes these sizes unusable for the kernel (the first rule broken), or None."""
    if not (is_pow2(M) and M <= MAX_ROWS):
        return f"M={M} rows: must be 1, 2 or {MAX_ROWS} (Triton block shapes are powers of 2)"
    if K < 1 or N < 1:
        return f"K={K}, N={N}: both must be >= 1"
    if not (is_pow2(bn) and N % bn == 0):
        return f"bn={bn} must be a power of 2 dividing N={N}"
    if not is_pow2(bk):
        return f"bk={bk} must be a power of 2"
    if splits < 1 or K % (splits * bk):
        return f"splits * bk = {splits} * {bk} must divide K={K}"
    return None


def supports(M: int, K: int, N: int, bn: int = 32, bk: int = 256, splits: int = 1) -> bool:
    """Whether the kernel takes these sizes: M a power of 2 up to `MAX_ROWS`, K, N >= 1, bn a
    power of 2 dividing N, bk a power of 2 and splits * bk dividing K."""
    return _size_problem(M, K, N, bn, bk, splits) is None


def gemv(x: jax.Array, w: jax.Array, *, out_dtype=None, bn: int = 32, bk: int = 256,
         splits: int = 1, num_warps: int = 4, num_stages: int = 4,
         interpret: bool = False) -> jax.Array:
    """``x @ w`` for a few rows in one Pallas launch; with ``splits`` = 1 the contract of
    `reference.gemv`.

    Args:
        x: [M, K] float, M in (1, 2, 4) (`MAX_ROWS`).
        w: [K, N] float.
        out_dtype: of y (default x.dtype); ignored with ``splits`` > 1.
        bn: output columns per program (a power of 2 dividing N).
        bk: rows of ``w`` per pipelined tile (a power of 2; ``splits * bk`` divides K).
        splits: parts of K, one program each per column strip ((N / bn) x splits programs).
            Above 1 the result is their float32 partial sums, for a consumer to add (e.g.
            `pallas_kernels.add_rms_norm` takes them as its delta; its Triton kernel needs a
            power-of-2 count).
        num_warps, num_stages: Triton launch parameters.
        interpret: run the Pallas interpreter (CPU tests).
    Returns:
        y [M, N] in ``out_dtype`` (float32 accumulation); with ``splits`` > 1, float32 partial
        sums [splits, M, N] that add up to y.
    Raises:
        ValueError: see `reference.check_args`; sizes the kernel does not take (`supports`).
    """
    M, K, N = check_args(x, w)
    ints = {}
    for name, v in (("bn", bn), ("bk", bk), ("splits", splits), ("num_warps", num_warps),
                    ("num_stages", num_stages)):
        try:
            if isinstance(v, bool):
                raise TypeError
            ints[name] = operator.index(v)
        except TypeError:
            raise ValueError(f"{name}={v!r} must be an integer") from None
    if ints["splits"] < 1 or ints["num_warps"] < 1 or ints["num_stages"] < 1:
        raise ValueError(f"splits, num_warps and num_stages must be >= 1; got {ints['splits']}, "
                         f"{ints['num_warps']}, {ints['num_stages']}")
    problem = _size_problem(M, K, N, ints["bn"], ints["bk"], ints["splits"])
    if problem:
        raise ValueError(f"gemv kernel: {problem}")
    dtype = jnp.float32 if ints["splits"] > 1 else jnp.dtype(out_dtype or x.dtype)
    return _gemv(x, w, out_dtype=dtype, interpret=bool(interpret), **ints)
