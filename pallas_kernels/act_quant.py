"""Per-token fp8 (e4m3) quantisation of a W8A8 GEMM's input, computed in the op that produces it,
as Pallas/Triton kernels: the residual add + RMSNorm before q|k|v and gate|up
(`add_rms_norm_quant`), and the SwiGLU ``silu(gate) * up`` before down (`silu_mul_quant`). Each
writes the e4m3 activations and their f32 scale f32[M, 1] instead of the activations in the
compute dtype, so the per-token amax and the convert run in no kernel of their own.

The numbers are those of the plain-jnp code the engine runs, their reference
(`jaxinfer.models.layers.add_rms_norm`, `rms_norm`, `mlp`, then `quantize.quantize_tokens`:
``scale = amax(|y|) / 448`` over the token, 1 for a row of zeros, and ``y / scale`` clipped to
+-448 rounded to e4m3), with the roundings to the compute dtype that code writes.
One program quantises ``block_m`` rows; each row is held in registers, read once in chunks of a
power of 2 (Triton's block sizes) and written once. Shape letters: M tokens, D model width, F FFN
width. Sources: vLLM's fused ``rms_norm_dynamic_per_token_quant`` and ``scaled_fp8_quant``
(``use_per_token_if_dynamic``)."""

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.kv_quant import FP8, FP8_MAX, quantize
from pallas_kernels.sizes import is_pow2, raise_first

MAX_ROW = 32768  # elements of a program's rows (block_m x D or F), all held in registers
MAX_CHUNK = 8192  # elements of the longest chunk of a row one Triton op reads
MAX_CHUNKS = 32  # chunks a row (the loop over them is unrolled)
FLOATS = (jnp.float32, jnp.bfloat16, jnp.float16)


def row_chunk(n: int) -> int:
    """The chunk a row of ``n`` elements is read in: the largest power of 2 <= `MAX_CHUNK`
    dividing ``n``."""
    return math.gcd(n, MAX_CHUNK)


def rows_per_program(M: int, n: int, block_m: int) -> int:
    """The rows a program of M rows of ``n`` elements takes: the largest power of 2 <=
    ``block_m`` (a power of 2) dividing M with at most `MAX_ROW` elements in all."""
    rows = math.gcd(M, block_m)
    while rows > 1 and rows * n > MAX_ROW:
        rows //= 2
    return rows


def supported(n: int) -> bool:
    """Whether the kernels take rows of ``n`` elements (D or F): 1 <= n <= `MAX_ROW`, read in at
    most `MAX_CHUNKS` chunks of `row_chunk`."""
    return 1 <= n <= MAX_ROW and n // row_chunk(n) <= MAX_CHUNKS


def _row_checks(name: str, n: int, block_m: int, num_warps: int) -> list:
    """`raise_first`'s checks of a row of ``n`` elements and the knobs (`supported`)."""
    return [
        (
            n < 1 or n // row_chunk(n) > MAX_CHUNKS,
            f"{name}={n} must be a positive multiple of a power of 2 >= {name} / {MAX_CHUNKS} "
            "(rows are read in power-of-2 chunks)",
        ),
        (n > MAX_ROW, f"{name}={n} must be <= {MAX_ROW} (a row is held in registers)"),
        (not is_pow2(block_m), f"block_m={block_m} must be a power of 2"),
        (not is_pow2(num_warps), f"num_warps={num_warps} must be a power of 2"),
    ]


def _quantize_rows(ys, starts, chunk, q_ref, s_ref):
    """Rows given as chunks ``ys`` [block_m, chunk] (at columns ``starts``; any float dtype, kept
    in it to spare registers) quantised per row in f32 (`quantize.quantize_tokens`) into
    ``q_ref``; their scales into ``s_ref`` [block_m, 1]."""
    ys = [y.astype(jnp.float32) for y in ys]
    amax = functools.reduce(jnp.maximum, [jnp.max(jnp.abs(y), axis=1, keepdims=True) for y in ys])
    scale = jnp.where(amax > 0, amax / FP8_MAX, 1.0).astype(jnp.float32)
    for y, c in zip(ys, starts):
        q_ref[:, pl.ds(c, chunk)] = quantize(y, scale, FP8)
    s_ref[...] = scale


def _norm_kernel(*refs, eps, chunk, has_delta):
    if has_delta:
        x_ref, d_ref, w_ref, sum_ref, q_ref, s_ref = refs
    else:
        x_ref, w_ref, q_ref, s_ref = refs
    dtype, D = x_ref.dtype, x_ref.shape[1]
    starts = range(0, D, chunk)
    xs = []
    for c in starts:
        x = x_ref[:, pl.ds(c, chunk)]
        if has_delta:
            x = (x + d_ref[:, pl.ds(c, chunk)]).astype(dtype)
            sum_ref[:, pl.ds(c, chunk)] = x
        xs.append(x)
    f32 = jnp.float32
    squares = [jnp.sum(jnp.square(x.astype(f32)), axis=1, keepdims=True) for x in xs]
    r = jax.lax.rsqrt(functools.reduce(jnp.add, squares) / D + eps)
    ys = [
        w_ref[:, pl.ds(c, chunk)].astype(dtype) * (x.astype(f32) * r).astype(dtype)
        for x, c in zip(xs, starts)
    ]
    _quantize_rows(ys, starts, chunk, q_ref, s_ref)


@functools.partial(jax.jit, static_argnames=("eps", "block_m", "num_warps", "interpret"))
def _norm_call(x, delta, w, *, eps, block_m, num_warps, interpret):
    (M, D), has_delta = x.shape, delta is not None
    row = pl.BlockSpec((block_m, D), lambda i: (i, 0))
    scale = pl.BlockSpec((block_m, 1), lambda i: (i, 0))
    outs = [jax.ShapeDtypeStruct((M, D), FP8), jax.ShapeDtypeStruct((M, 1), jnp.float32)]
    chunk = row_chunk(D)
    return pl.pallas_call(
        functools.partial(_norm_kernel, eps=eps, chunk=chunk, has_delta=has_delta),
        out_shape=[jax.ShapeDtypeStruct((M, D), x.dtype)] * has_delta + outs,
        grid=(M // block_m,),
        in_specs=[row] * (1 + has_delta) + [pl.BlockSpec((1, D), lambda i: (0, 0))],
        out_specs=[row] * (1 + has_delta) + [scale],
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
        name=f"add_rms_norm_quant_m{block_m}_c{chunk}",
    )(*[a for a in (x, delta) if a is not None], w.reshape(1, D))


def add_rms_norm_quant(
    x: jax.Array,
    delta: jax.Array | None,
    w: jax.Array,
    *,
    eps: float,
    interpret: bool = False,
    block_m: int = 1,
    num_warps: int = 8,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`layers.add_rms_norm`, then `quantize.quantize_tokens` of its normalised value, in one
    pass over each row: x, delta [M, D] (or [..., D], flattened to M rows; bf16, f16 or f32;
    ``delta`` None: no add), w [D] -> (x + delta rounded to x.dtype, x itself when ``delta`` is
    None; float8_e4m3fn [M, D]; f32 scale [M, 1]). The normalised value is `layers.rms_norm`'s
    step for step: f32 statistics, rounded to x.dtype before its product with ``w`` in x.dtype
    (HF's RMSNorm). Against the jnp code compiled with XLA's ``xla_allow_excess_precision`` off
    (on, XLA may skip roundings to x.dtype that the code writes and the kernel does): the same
    bits interpreted, but for an f32 scale's last bit (the order of the f32 sum of squares);
    compiled, Triton's summation order and rsqrt may differ from XLA's in the last bit: rarely,
    an e4m3 value one step apart. Knobs: ``block_m`` rows a program at most (a power of 2;
    `rows_per_program`), ``num_warps``. ValueError: shapes, dtypes or knobs not as stated
    (D <= `MAX_ROW`, read in at most `MAX_CHUNKS` power-of-2 chunks). Source: vLLM's
    ``rms_norm_dynamic_per_token_quant`` (with its residual)."""
    D = x.shape[-1] if x.ndim else 0
    raise_first(
        [
            (x.ndim < 1 or x.dtype not in FLOATS, f"x must be float [..., D]; got {x.dtype}"),
            (w.shape != (D,), f"w must be [D={D}]; got shape {w.shape}"),
            (
                delta is not None and (delta.shape != x.shape or delta.dtype not in FLOATS),
                f"delta must be float of x's shape {x.shape}; got "
                f"{None if delta is None else (delta.dtype, delta.shape)}",
            ),
            *_row_checks("D", D, block_m, num_warps),
        ]
    )
    lead, M = x.shape[:-1], math.prod(x.shape[:-1])
    if M == 0:
        return x, jnp.zeros(x.shape, FP8), jnp.ones((*lead, 1), jnp.float32)
    out = _norm_call(
        x.reshape(M, D),
        None if delta is None else delta.reshape(M, D),
        w,
        eps=float(eps),
        block_m=rows_per_program(M, D, block_m),
        num_warps=num_warps,
        interpret=bool(interpret),
    )
    *total, q, scale = out
    total = total[0].reshape(x.shape) if total else x
    return total, q.reshape(x.shape), scale.reshape(*lead, 1)


def _sigmoid(g: jax.Array) -> jax.Array:
    """``jax.nn.sigmoid(g)`` as JAX lowers it, ``1 / (1 + exp(-g))`` with each step rounded to
    g.dtype, every step computed in f32 (Triton divides no bf16)."""
    f32, dtype = jnp.float32, g.dtype
    e = jnp.exp(-g.astype(f32)).astype(dtype)
    return (1.0 / (e.astype(f32) + 1.0).astype(dtype).astype(f32)).astype(dtype)


def _silu_kernel(gu_ref, q_ref, s_ref, *, chunk):
    F = q_ref.shape[1]
    starts = range(0, F, chunk)
    hs = []
    for c in starts:
        g, u = gu_ref[:, pl.ds(c, chunk)], gu_ref[:, pl.ds(F + c, chunk)]
        hs.append(g * _sigmoid(g) * u)
    _quantize_rows(hs, starts, chunk, q_ref, s_ref)


@functools.partial(jax.jit, static_argnames=("block_m", "num_warps", "interpret"))
def _silu_call(gate_up, *, block_m, num_warps, interpret):
    M, F = gate_up.shape[0], gate_up.shape[1] // 2
    chunk = row_chunk(F)
    return pl.pallas_call(
        functools.partial(_silu_kernel, chunk=chunk),
        out_shape=[jax.ShapeDtypeStruct((M, F), FP8), jax.ShapeDtypeStruct((M, 1), jnp.float32)],
        grid=(M // block_m,),
        in_specs=[pl.BlockSpec((block_m, 2 * F), lambda i: (i, 0))],
        out_specs=[
            pl.BlockSpec((block_m, F), lambda i: (i, 0)),
            pl.BlockSpec((block_m, 1), lambda i: (i, 0)),
        ],
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
        name=f"silu_mul_quant_m{block_m}_c{chunk}",
    )(gate_up)


def silu_mul_quant(
    gate_up: jax.Array, *, interpret: bool = False, block_m: int = 1, num_warps: int = 8
) -> tuple[jax.Array, jax.Array]:
    """The SwiGLU's ``silu(gate) * up``, then `quantize.quantize_tokens` of it, in one pass over
    each row: gate_up [M, 2F] (or [..., 2F], flattened to M rows; bf16, f16 or f32) laid out
    ``[gate | up]`` as `layers.mlp` reads it with ``shards`` 1 (the tensor-parallel layout of
    several column groups is not supported) -> (float8_e4m3fn [M, F], f32 scale [M, 1]). The
    product is `layers.mlp`'s step for step in gate_up's dtype: ``jax.nn.silu(gate) * up`` with
    the sigmoid as JAX lowers it (`_sigmoid`). Against the jnp code compiled with XLA's
    ``xla_allow_excess_precision`` off (on, XLA may skip roundings that the code writes and the
    kernel does): the same bits interpreted; compiled, Triton's exp and division may differ from
    XLA's in the last bit: rarely, an e4m3 value one step apart. Knobs: ``block_m`` rows a
    program at most (a power of 2; `rows_per_program`), ``num_warps``. ValueError: shapes, dtypes
    or knobs not as stated (F <= `MAX_ROW`, read in at most `MAX_CHUNKS` power-of-2 chunks).
    Source: vLLM's ``silu_and_mul`` followed by ``scaled_fp8_quant`` (per token), fused."""
    n = gate_up.shape[-1] if gate_up.ndim else 0
    raise_first(
        [
            (
                gate_up.ndim < 1 or gate_up.dtype not in FLOATS or n % 2,
                f"gate_up must be float [..., 2F]; got {gate_up.dtype}{list(gate_up.shape)}",
            ),
            *_row_checks("F", n // 2, block_m, num_warps),
        ]
    )
    lead, M, F = gate_up.shape[:-1], math.prod(gate_up.shape[:-1]), n // 2
    if M == 0:
        return jnp.zeros((*lead, F), FP8), jnp.ones((*lead, 1), jnp.float32)
    q, scale = _silu_call(
        gate_up.reshape(M, n),
        block_m=rows_per_program(M, F, block_m),
        num_warps=num_warps,
        interpret=bool(interpret),
    )
    return q.reshape(*lead, F), scale.reshape(*lead, 1)
