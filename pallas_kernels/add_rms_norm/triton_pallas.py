"""Residual add + RMSNorm as one Pallas/Triton kernel; contract and sources: `reference.py`."""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.add_rms_norm.reference import check_args
from pallas_kernels.sizes import is_int, is_pow2


def _kernel(x_ref, d_ref, w_ref, xo_ref, h_ref, *, D, eps, has_delta, partials):
    dt = x_ref.dtype
    x = x_ref[0, :]
    if has_delta:
        if partials:  # float32 partial sums [splits, 1, D]: their sum, rounded as a GEMM output is
            d = jnp.sum(d_ref[:, 0, :], axis=0).astype(dt).astype(jnp.float32)
        else:
            d = d_ref[0, :].astype(jnp.float32)
        x = (x.astype(jnp.float32) + d).astype(dt)
    xo_ref[0, :] = x
    xf = x.astype(jnp.float32)
    r = jax.lax.rsqrt(jnp.sum(xf * xf) / D + eps)
    normed = (xf * r).astype(dt).astype(jnp.float32)
    h_ref[0, :] = (normed * w_ref[:].astype(dt).astype(jnp.float32)).astype(dt)


@functools.partial(jax.jit, static_argnames=("eps", "interpret", "num_warps"))
def _add_rms_norm(x, delta, weight, *, eps, interpret, num_warps):
    S, D = x.shape
    has_delta = delta is not None
    delta = delta if has_delta else x                               # None: unread
    partials = delta.ndim == 3
    row = pl.BlockSpec((1, D), lambda i: (i, 0))
    d_spec = pl.BlockSpec((delta.shape[0], 1, D), lambda i: (0, i, 0)) if partials else row
    return pl.pallas_call(
        functools.partial(_kernel, D=D, eps=float(eps), has_delta=has_delta, partials=partials),
        out_shape=[jax.ShapeDtypeStruct((S, D), x.dtype)] * 2,
        grid=(S,),
        in_specs=[row, d_spec, pl.BlockSpec((D,), lambda i: (0,))],
        out_specs=[row, row],
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
        name="add_rms_norm",
    )(x, delta, weight)


def supports(D: int) -> bool:
    """Whether the kernel takes rows of D elements (Triton block shapes are powers of 2)."""
    return is_pow2(D)


def add_rms_norm(x: jax.Array, delta: jax.Array | None, weight: jax.Array, *,
                 eps: float = 1e-6, interpret: bool = False,
                 num_warps: int | None = None) -> tuple[jax.Array, jax.Array]:
    """`reference.add_rms_norm` in one Pallas launch (D and the partial-sum count powers of 2:
    `supports`); num_warps None: D / 256 clamped to 4..16, else a power of 2 <= 32. ValueError:
    `reference.check_args`; D or the count not a power of 2; a bad ``num_warps``."""
    if num_warps is not None and not (is_int(num_warps) and is_pow2(num_warps) and num_warps <= 32):
        raise ValueError(f"num_warps={num_warps!r} must be None or a power-of-2 integer in 1..32")
    S, D = check_args(x, delta, weight, eps)
    if not supports(D):
        raise ValueError(f"hidden size D={D} must be a power of 2 for the Triton kernel")
    if delta is not None and delta.ndim == 3 and not supports(delta.shape[0]):
        raise ValueError(f"delta has {delta.shape[0]} partial sums; the Triton kernel takes a "
                         "power of 2")
    if S == 0:  # no rows: no launch (a grid of 0 programs is not valid)
        return x, x
    warps = min(16, max(4, D // 256)) if num_warps is None else int(num_warps)
    return _add_rms_norm(x, delta, weight, eps=float(eps), interpret=bool(interpret),
                         num_warps=warps)
