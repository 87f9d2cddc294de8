"""fp8-weight GEMM as one Pallas launch with the Triton lowering, `reference.fp8_matmul`'s contract.
Each program owns ``block_n`` output columns (tiled path: and ``block_m`` rows) over one of
``splits`` contiguous K ranges, streaming its ``[block_k, block_n]`` fp8 weight tiles through a
``num_stages`` pipeline: GEMV path (M <= ``gemv_rows``): f32 FMAs, reduced over K at the end; tiled
path: bf16 ``dot`` of x and the upcast tile, f32 accumulation. The per-channel scale is applied in
the epilogue; ``splits > 1``: f32 partials summed by XLA. Sources: split-K GEMV (vLLM/TensorRT-LLM
fp8 weight-only kernels); W8A16 "upcast after load" (tokamax's sm90 quantized GEMM)."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.fp8_matmul.reference import check_args
from pallas_kernels.sizes import is_pow2, raise_first, round_up

_TN = (((0,), (1,)), ((), ()))  # w [bk, bn], x [rows, bk] -> w^T x^T [bn, rows]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Fp8MatmulConfig:
    """Knobs (checked in ``__post_init__``): gemv_rows (M <= it: GEMV path; 0: never), block_m
    (tiled rows), block_n, block_k, splits (K ranges), num_warps, num_stages, swap_ab (w^T x^T)."""

    gemv_rows: int = 2
    block_m: int = 64
    block_n: int = 128
    block_k: int = 64
    splits: int = 1
    num_warps: int = 4
    num_stages: int = 3
    swap_ab: bool = False

    def __post_init__(self):
        raise_first([
            (not 0 <= self.gemv_rows <= 16, f"gemv_rows={self.gemv_rows} must be in 0..16"),
            *[(not (is_pow2(v) and v >= 16), f"{k}={v} must be a power of 2 >= 16")
              for k, v in (("block_m", self.block_m), ("block_n", self.block_n),
                           ("block_k", self.block_k))],
            (self.splits < 1, f"splits={self.splits} must be >= 1"),
            (not (is_pow2(self.num_warps) and self.num_warps <= 16),
             f"num_warps={self.num_warps} must be a power of 2 in 1..16"),
            (self.num_stages < 1, f"num_stages={self.num_stages} must be >= 1")])


def default_config(M: int, K: int, N: int) -> Fp8MatmulConfig:
    """Knobs for x [M, K] @ w [K, N] (H200 sweep, benchmarks/fp8_gemm_notes.md): M <= 2: GEMV tiles
    [32, 128], 8 warps; else dot tiles of 16 (M <= 16), 64 (M <= 64) or 128 rows x 128 x 64; splits:
    the fewest (power of 2) giving >= 512 (GEMV), 384 (M <= 64) or 192 programs, >= 4 K tiles."""
    gemv = M <= 2
    bk = 32 if gemv else 64
    bm = 1 if gemv else 16 if M <= 16 else 64 if M <= 64 else 128
    target = 512 if gemv else 384 if M <= 64 else 192
    splits, tiles = 1, -(-M // bm) * max(1, N // 128)
    while tiles * splits < target and K % (2 * splits * bk) == 0 and K // (2 * splits * bk) >= 4:
        splits *= 2
    return Fp8MatmulConfig(block_m=max(bm, 16), block_k=bk, splits=splits,
                           num_warps=8 if gemv else 4)


def _kernel(x_ref, w_ref, s_ref, o_ref, *, gemv: bool, swap_ab: bool, bk: int, steps: int):
    """x_ref [rows, K] bf16, w_ref [K, bn] fp8, s_ref f32[bn] -> o_ref [rows, bn] (partials f32)."""
    k_lo = pl.program_id(1) * steps

    def tile(i):
        k0 = pl.multiple_of((k_lo + i) * bk, bk)
        return k0, w_ref[pl.ds(k0, bk), :]

    if gemv:
        def gemv_step(i, accs):
            k0, w = tile(i)
            w = w.astype(jnp.float32)
            return tuple(a + x_ref[m, pl.ds(k0, bk)].astype(jnp.float32)[:, None] * w
                         for m, a in enumerate(accs))
        zero = jnp.zeros((bk, w_ref.shape[1]), jnp.float32)
        accs = lax.fori_loop(0, steps, gemv_step, (zero,) * x_ref.shape[0])
        for m, a in enumerate(accs):
            o_ref[m, :] = (jnp.sum(a, axis=0) * s_ref[...]).astype(o_ref.dtype)
        return

    def dot_step(i, acc):
        k0, w = tile(i)
        x, w = x_ref[:, pl.ds(k0, bk)], w.astype(jnp.bfloat16)
        if swap_ab:
            return acc + lax.dot_general(w, x, _TN, preferred_element_type=jnp.float32)
        return acc + jnp.dot(x, w, preferred_element_type=jnp.float32)
    shape = o_ref.shape[::-1] if swap_ab else o_ref.shape
    acc = lax.fori_loop(0, steps, dot_step, jnp.zeros(shape, jnp.float32))
    o_ref[...] = ((acc.T if swap_ab else acc) * s_ref[...][None, :]).astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("cfg", "interpret"))
def _fp8_matmul(x, w, scale, *, cfg: Fp8MatmulConfig, interpret: bool):
    (M, K), N = x.shape, w.shape[1]
    gemv = M <= cfg.gemv_rows
    bm, bn, S = (M if gemv else cfg.block_m), cfg.block_n, cfg.splits
    Mp = round_up(M, bm)
    xp = jnp.pad(x, ((0, Mp - M), (0, 0))) if Mp != M else x
    kernel = functools.partial(_kernel, gemv=gemv, swap_ab=cfg.swap_ab, bk=cfg.block_k,
                               steps=K // (S * cfg.block_k))
    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((S, Mp, N), jnp.bfloat16 if S == 1 else jnp.float32),
        grid=(Mp // bm, S, N // bn),
        in_specs=[pl.BlockSpec((bm, K), lambda r, s, j: (r, 0)),
                  pl.BlockSpec((K, bn), lambda r, s, j: (0, j)),
                  pl.BlockSpec((bn,), lambda r, s, j: (j,))],
        out_specs=pl.BlockSpec((None, bm, bn), lambda r, s, j: (s, r, j)),
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
        name=f"fp8_{'gemv' if gemv else 'gemm'}_m{bm}_n{bn}_k{cfg.block_k}_s{S}",
    )(xp, w, scale)
    out = out[0] if S == 1 else out.sum(0).astype(jnp.bfloat16)
    return out[:M] if Mp != M else out


def fp8_matmul(x: jax.Array, w: jax.Array, scale: jax.Array, *,
               config: Fp8MatmulConfig | None = None, interpret: bool = False) -> jax.Array:
    """`reference.fp8_matmul` in one Pallas/Triton launch (plus an f32 sum when splits > 1): x bf16
    [M, K], w float8_e4m3fn [K, N], scale f32[N] -> bf16 [M, N]; config None: `default_config`.
    ValueError: `reference.check_args`; N % block_n; K % (splits * block_k)."""
    M, K, N = check_args(x, w, scale)
    cfg = config if config is not None else default_config(M, K, N)
    raise_first([
        (N % cfg.block_n, f"N={N} must be a multiple of block_n={cfg.block_n}"),
        (K % (cfg.splits * cfg.block_k),
         f"K={K} must be a multiple of splits * block_k = {cfg.splits} * {cfg.block_k}")])
    if M == 0:
        return jnp.zeros((0, N), jnp.bfloat16)
    return _fp8_matmul(x, w, scale, cfg=cfg, interpret=bool(interpret))
