"""Combine of a split (flash-decoding) decode attention: the normalised partial outputs of S
sequence splits and their log-sum-exps -> the attention output, as one Pallas kernel with the
Triton lowering, beside its plain-jnp reference.

    out[b, k*G + g] = sum_s w[b, k, s, g] * o[b, k, s, g] / sum_s w[b, k, s, g],
    w = exp(lse - max_s lse)        (splits with no key have lse = -inf and weight 0)

What the kernel replaces: XLA runs the jnp reference as two fusions (the weights, then the
weighted sum, slice and cast), 1.1 + 1.3 us per layer of a B=1 Qwen3-8B decode step on the H200;
here one program per (row, KV head) reads the S partials once. Measured in that step (BENCHMARKS.md,
eighth session) it saved nothing (4.45 ms either way), so the mosaic kernel uses it only when
asked (``combine_kernel=True``).
Sources: Dao et al. 2023, "Flash-Decoding for long-context inference" (the split and combine);
Milakov & Gimelshein 2018 (online softmax).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.sizes import is_pow2, next_pow2

MAX_TILE = 16384   # S_pow2 * Gp * H float32 elements one program may hold (64 KB of registers)


def reference(o: jax.Array, lse: jax.Array, *, num_heads: int, out_dtype) -> jax.Array:
    """The combine in plain jnp.

    Args:
        o: f32[B, K, S, Gp, H] each split's normalised output for the Gp query rows of each KV
            head (rows past G = num_heads / K are padding and dropped).
        lse: f32[B, K, S, Gp] natural-log log-sum-exp of each split's scores (-inf: no key).
        num_heads: N.
        out_dtype: dtype of the result.
    Returns:
        [B, N, H] in ``out_dtype``; rows with no key in any split are zeros.
    """
    B, K, _, _, H = o.shape
    G = num_heads // K
    mx = jnp.max(lse, axis=2, keepdims=True)
    mx = jnp.where(jnp.isfinite(mx), mx, 0.0)
    w = jnp.exp(lse - mx)                                       # [B, K, S, Gp]; 0 for empty splits
    den = jnp.sum(w, axis=2)
    out = jnp.einsum("bksg,bksgh->bkgh", w, o) / jnp.where(den > 0, den, 1.0)[..., None]
    return out[:, :, :G].reshape(B, num_heads, H).astype(out_dtype)


def supports(S: int, Gp: int, H: int) -> bool:
    """Whether the kernel takes these sizes: Gp and H powers of 2 (Triton block shapes), and the
    S partials of one program (S rounded up to a power of 2) within `MAX_TILE` elements."""
    return S > 0 and is_pow2(Gp) and is_pow2(H) and next_pow2(S) * Gp * H <= MAX_TILE


def _kernel(lse_ref, o_ref, out_ref, *, S, Sp, G, Gp, H, N):
    b = pl.program_id(0)
    k = pl.program_id(1)
    s_ok = jax.lax.broadcasted_iota(jnp.int32, (Sp, Gp), 0) < S
    lse = plgpu.load(lse_ref.at[b, k, pl.ds(0, Sp), :], mask=s_ok, other=-jnp.inf)  # [Sp, Gp]
    mx = jnp.max(lse, axis=0)
    mx = jnp.where(mx > -jnp.inf, mx, 0.0)
    w = jnp.exp(lse - mx[None, :])                                # 0 where lse = -inf
    den = jnp.sum(w, axis=0)
    s_ok3 = jax.lax.broadcasted_iota(jnp.int32, (Sp, Gp, H), 0) < S
    o = plgpu.load(o_ref.at[b, k, pl.ds(0, Sp), :, :], mask=s_ok3, other=0.0)      # [Sp, Gp, H]
    num = jnp.sum(w[:, :, None] * o, axis=0)                       # [Gp, H]
    out = num / jnp.where(den > 0, den, 1.0)[:, None]
    rows_ok = jax.lax.broadcasted_iota(jnp.int32, (Gp, H), 0) < G
    plgpu.store(out_ref.at[b, pl.ds(k * G, Gp), :], out.astype(out_ref.dtype), mask=rows_ok)


@functools.partial(jax.jit, static_argnames=("num_heads", "out_dtype", "interpret", "num_warps"))
def _combine(o, lse, *, num_heads, out_dtype, interpret, num_warps):
    B, K, S, Gp, H = o.shape
    G = num_heads // K
    full = lambda shape: pl.BlockSpec(shape, lambda *_: (0,) * len(shape))  # noqa: E731
    return pl.pallas_call(
        functools.partial(_kernel, S=S, Sp=next_pow2(S), G=G, Gp=Gp, H=H, N=num_heads),
        out_shape=jax.ShapeDtypeStruct((B, num_heads, H), out_dtype),
        grid=(B, K),
        in_specs=[full(lse.shape), full(o.shape)],
        out_specs=full((B, num_heads, H)),
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
        name="split_combine",
    )(lse, o)


def combine(o: jax.Array, lse: jax.Array, *, num_heads: int, out_dtype,
            interpret: bool = False, num_warps: int = 4) -> jax.Array:
    """`reference`'s contract in one Pallas launch (grid (B, K)).

    Args:
        o, lse, num_heads, out_dtype: as in `reference`.
        interpret: run the Pallas interpreter (CPU tests).
        num_warps: warps per program.
    Returns:
        [B, N, H] in ``out_dtype``.
    Raises:
        ValueError: shapes that disagree or have an empty axis, a non-float ``out_dtype``, or
            sizes `supports` rejects.
    """
    if o.ndim != 5 or lse.shape != o.shape[:4]:
        raise ValueError(f"o must be f32[B, K, S, Gp, H] and lse f32[B, K, S, Gp]; got {o.shape} "
                         f"and {lse.shape}")
    B, K, S, Gp, H = o.shape
    if min(o.shape) < 1:
        raise ValueError(f"o must have no empty axis; got shape {o.shape}")
    if out_dtype is None or not jnp.issubdtype(jnp.dtype(out_dtype), jnp.floating):
        raise ValueError(f"out_dtype must be a floating dtype; got {out_dtype!r}")
    if num_heads % K or not 0 < num_heads // K <= Gp:
        raise ValueError(f"num_heads={num_heads} must be K={K} times G with 0 < G <= Gp={Gp}")
    if not supports(S, Gp, H):
        raise ValueError(f"split combine kernel: S={S}, Gp={Gp}, H={H} not supported (Gp, H "
                         f"powers of 2 and pow2(S) * Gp * H <= {MAX_TILE}); use `reference`")
    return _combine(o, lse, num_heads=int(num_heads), out_dtype=jnp.dtype(out_dtype),
                    interpret=bool(interpret), num_warps=int(num_warps))
