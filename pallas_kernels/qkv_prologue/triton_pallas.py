"""The attention prologue (q/k RMSNorm + RoPE + K/V page write) as one Pallas kernel with the
Triton lowering.

What it replaces: in a B=1 Qwen3-8B decode step XLA runs this part of each layer as six small
fusions of 1.1-2.4 us each (the q/k RMSNorm statistics, the rotated key rows, the value rows, two
K/V page writes, the rotated and padded queries; BENCHMARKS.md, "Decode step"), about 10 us of
the 11 us per layer that everything besides the GEMMs may take for the step to reach 85% of the
copy bandwidth. Here the first five are one launch; the mosaic decode kernel's wrapper still pads
q to 8 heads per KV group, and where XLA splits the q/k/v GEMM over K it now sums the partials in a
fusion of their own.

One program per (token s, head j) of the N + 2K heads of the fused projection: a query or key head
is normalized (when q_norm/k_norm are given) and rotated, then stored into q or into the key pool;
a value head is copied into the value pool. Each head is read as its two RoPE halves ([H/2]
vectors), so no in-register slicing is needed. The pools are aliased to the outputs
(``input_output_aliases``), so XLA can update them in place; the GPU test checks that a jit with
the pools donated compiles without a pool-sized copy.

Status: validated in interpret mode on the CPU and compiled on the H200 against
`reference.qkv_prologue` (``tests/kernels/test_qkv_prologue_gpu.py``, ``-m gpu``). Used by decode
steps on GPU by default (``EngineConfig.qkv_prologue="auto"``); B=1 Qwen3-8B decode 4.62 vs
4.73 ms, no change at B=32/256 (BENCHMARKS.md).
Sources: as `reference.py`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.qkv_prologue.reference import check_args


def _kernel(layer_ref, slots_ref, cos_ref, sin_ref, w_ref, qkv_ref, k_in, v_in,
            q_ref, k_ref, v_ref, *, N, K, H, page_size, eps, has_norm):
    del k_in, v_in  # aliased to k_ref, v_ref
    s = pl.program_id(0)
    j = pl.program_id(1)
    half = H // 2
    lo, hi = pl.ds(0, half), pl.ds(half, half)
    slot = slots_ref[s]
    page, off = slot // page_size, slot % page_size
    layer = layer_ref[0]
    dt = q_ref.dtype

    @pl.when(j < N + K)
    def _query_or_key():
        x1 = qkv_ref[s, j, lo]
        x2 = qkv_ref[s, j, hi]
        if has_norm:
            f1, f2 = x1.astype(jnp.float32), x2.astype(jnp.float32)
            var = (jnp.sum(f1 * f1) + jnp.sum(f2 * f2)) / H
            r = jax.lax.rsqrt(var + eps)
            row = (j >= N).astype(jnp.int32)                  # 0: q_norm, 1: k_norm
            w1, w2 = w_ref[row, lo], w_ref[row, hi]
            # HF order: normalized value rounded to the compute dtype, then times the weight.
            x1 = ((f1 * r).astype(dt).astype(jnp.float32) * w1.astype(jnp.float32)).astype(dt)
            x2 = ((f2 * r).astype(dt).astype(jnp.float32) * w2.astype(jnp.float32)).astype(dt)
        c, sn = cos_ref[s, :], sin_ref[s, :]
        f1, f2 = x1.astype(jnp.float32), x2.astype(jnp.float32)
        o1, o2 = f1 * c - f2 * sn, f2 * c + f1 * sn

        @pl.when(j < N)
        def _query():
            q_ref[s, j, lo] = o1.astype(dt)
            q_ref[s, j, hi] = o2.astype(dt)

        @pl.when(j >= N)
        def _key():
            k_ref[layer, page, j - N, off, lo] = o1.astype(dt).astype(k_ref.dtype)
            k_ref[layer, page, j - N, off, hi] = o2.astype(dt).astype(k_ref.dtype)

    @pl.when(j >= N + K)
    def _value():
        kh = j - N - K
        v_ref[layer, page, kh, off, lo] = qkv_ref[s, j, lo].astype(v_ref.dtype)
        v_ref[layer, page, kh, off, hi] = qkv_ref[s, j, hi].astype(v_ref.dtype)


@functools.partial(jax.jit, static_argnames=("N", "K", "eps", "interpret", "num_warps"))
def _prologue(qkv, w, cos, sin, slot_mapping, k_pool, v_pool, layer, *, N, K, eps, interpret,
              num_warps):
    S = qkv.shape[0]
    L, P, _, page_size, H = k_pool.shape
    has_norm = w is not None
    if w is None:
        w = jnp.ones((2, H), qkv.dtype)                      # unread
    kernel = functools.partial(_kernel, N=N, K=K, H=H, page_size=page_size, eps=float(eps),
                               has_norm=has_norm)
    full = lambda shape: pl.BlockSpec(shape, lambda *_: (0,) * len(shape))  # noqa: E731
    qkv3 = qkv.reshape(S, N + 2 * K, H)
    layer_arr = jnp.asarray(layer, jnp.int32).reshape(1)
    q, k_pool, v_pool = pl.pallas_call(
        kernel,
        out_shape=[jax.ShapeDtypeStruct((S, N, H), qkv.dtype),
                   jax.ShapeDtypeStruct(k_pool.shape, k_pool.dtype),
                   jax.ShapeDtypeStruct(v_pool.shape, v_pool.dtype)],
        grid=(S, N + 2 * K),
        in_specs=[full((1,)), full((S,)), full((S, H // 2)), full((S, H // 2)), full((2, H)),
                  full((S, N + 2 * K, H)), full(k_pool.shape), full(v_pool.shape)],
        out_specs=[full((S, N, H)), full(k_pool.shape), full(v_pool.shape)],
        input_output_aliases={6: 1, 7: 2},
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
        name="qkv_prologue",
    )(layer_arr, slot_mapping.astype(jnp.int32), cos.astype(jnp.float32),
      sin.astype(jnp.float32), w, qkv3, k_pool, v_pool)
    return q, k_pool, v_pool


def _is_pow2(x: int) -> bool:
    return x > 0 and not x & (x - 1)


def qkv_prologue(qkv: jax.Array, q_norm: jax.Array | None, k_norm: jax.Array | None,
                 cos: jax.Array, sin: jax.Array, slot_mapping: jax.Array, k_pool: jax.Array,
                 v_pool: jax.Array, *, layer, num_heads: int, num_kv_heads: int,
                 eps: float = 1e-6, interpret: bool = False,
                 num_warps: int = 1) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The attention prologue of one layer in one Pallas launch; same contract as
    `reference.qkv_prologue`.

    Args:
        qkv, q_norm, k_norm, cos, sin, slot_mapping, k_pool, v_pool, layer, num_heads,
            num_kv_heads, eps: as in `reference.qkv_prologue` (H/2 must be a power of 2 here;
            slots in [0, P * page_size) and layer in [0, L) are not checked: outside them the
            kernel writes out of bounds).
        interpret: run the Pallas interpreter (CPU tests).
        num_warps: warps per program (one head of H elements per program).
    Returns:
        (q [S, N, H] in qkv.dtype, k_pool, v_pool), the pools updated in place.
    Raises:
        ValueError: see `reference.check_args`; H/2 not a power of 2 (Triton vector shapes).
    """
    S, N, K, H = check_args(qkv, q_norm, k_norm, cos, sin, slot_mapping, k_pool, v_pool,
                            num_heads, num_kv_heads)
    if not _is_pow2(H // 2):
        raise ValueError(f"head dim H={H}: H/2 must be a power of 2 for the Triton kernel")
    w = None if q_norm is None else jnp.stack([q_norm, k_norm]).astype(qkv.dtype)
    return _prologue(qkv, w, cos, sin, slot_mapping, k_pool, v_pool, layer, N=N, K=K,
                     eps=float(eps), interpret=bool(interpret), num_warps=int(num_warps))
