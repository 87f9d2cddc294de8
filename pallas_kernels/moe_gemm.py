"""The grouped GEMM of a mixture-of-experts layer as a Pallas/Triton kernel: rows sorted by
expert times their expert's matrix, reading each chosen expert's weights once per tile of rows
and never an expert no row chose (`jax.lax.ragged_dot`'s contract, its reference).

Work items: each expert's rows are cut into tiles of ``block_m`` rows (`work_items`, computed on
the device from the group sizes, as megablox's group metadata); one program per (work item,
column block) accumulates ``[block_m, block_k] @ [block_k, block_n]`` products in f32 over the
contraction dimension, a zero-trip loop for the unused items at the end. Its tile goes to a
buffer of its own (no masked stores) and each row is gathered back from its item's tile.
Block-scaled fp8 weights (HF FP8 checkpoints, ``weight_block_size`` (bo, bi)): ``block_k``
divides bi and ``block_n`` divides bo, so no tile straddles a scale block, and each K step's
partial product is multiplied by its one scale before it is added (vLLM's
``fused_moe`` with ``block_shape``, DeepSeek-V3's block-wise fp8 GEMM).
Shape letters: M rows (token-expert pairs), E experts, I the contraction (in), O out, W work
items. Sources: Gale et al. 2023 (MegaBlocks); vLLM's ``fused_moe`` Triton kernel."""

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.sizes import is_pow2

MIN_BLOCK = 16  # Triton's dot needs every dimension >= 16


def block_for(n: int, largest: int) -> int:
    """The largest power of 2 <= ``largest`` dividing ``n`` (0 if below `MIN_BLOCK`)."""
    b = largest
    while b >= MIN_BLOCK and n % b:
        b //= 2
    return b if b >= MIN_BLOCK else 0


def default_blocks(I: int, O: int, block: tuple[int, int] | None = None) -> tuple[int, int]:
    """(block_k, block_n): the largest powers of 2 <= 64 dividing I and O, and with scale
    ``block`` (bo, bi) also bi and bo (0 where below `MIN_BLOCK`)."""
    bo, bi = block or (0, 0)
    return block_for(math.gcd(I, bi), 64), block_for(math.gcd(O, bo), 64)


def supported(w_shape: tuple[int, ...], block: tuple[int, int] | None = None) -> bool:
    """Whether a stack w [E, I, O] (scale ``block`` (bo, bi) or None) has tile sizes: I and O
    (and with ``block`` gcd(I, bi), gcd(O, bo)) divisible by 16 at least."""
    return len(w_shape) == 3 and all(default_blocks(*w_shape[1:], block))


def work_items(sizes: jax.Array, M: int, block_m: int) -> tuple[jax.Array, ...]:
    """Group sizes i32[E] (summing to M) -> (expert i32[W], first row i32[W], rows i32[W],
    item i32[M], offset i32[M]): each expert's rows in tiles of ``block_m``, W =
    ceil(M / block_m) + min(E, M) (a bound on the tiles; unused items have 0 rows), and each
    row's item and place in its tile."""
    E = sizes.shape[0]
    W = -(-M // block_m) + min(E, M)
    starts = jnp.cumsum(sizes) - sizes
    tiles = -(-sizes // block_m)
    first_item = jnp.cumsum(tiles) - tiles
    i = jnp.arange(W, dtype=jnp.int32)
    expert = jnp.clip(jnp.searchsorted(jnp.cumsum(tiles), i, side="right"), 0, E - 1)
    t = i - first_item[expert]
    rows = jnp.clip(sizes[expert] - t * block_m, 0, block_m)
    first = starts[expert] + t * block_m
    r = jnp.arange(M, dtype=jnp.int32)
    row_expert = jnp.clip(jnp.searchsorted(jnp.cumsum(sizes), r, side="right"), 0, E - 1)
    local = r - starts[row_expert]
    item = first_item[row_expert] + local // block_m
    return (
        expert.astype(jnp.int32),
        first.astype(jnp.int32),
        rows.astype(jnp.int32),
        item.astype(jnp.int32),
        (local % block_m).astype(jnp.int32),
    )


def _kernel(e_ref, first_ref, rows_ref, x_ref, w_ref, *refs, block_m, nk, M, dtype, steps):
    """One (work item, column block j) tile. ``steps`` None, or (K blocks, column blocks) per
    scale block: then ``refs`` = (scale f32[E, I/bi, O/bo], out), else (out,)."""
    s_ref, o_ref = refs if steps else (None, *refs)
    i, j = pl.program_id(0), pl.program_id(1)
    e, first, n = e_ref[i], first_ref[i], rows_ref[i]
    valid = jnp.arange(block_m, dtype=jnp.int32) < n
    rows = jnp.where(valid, first + jnp.arange(block_m, dtype=jnp.int32), 0)
    rows = jnp.minimum(rows, M - 1)

    def body(kb, acc):
        x = jnp.where(valid[:, None], x_ref[rows, kb], 0).astype(dtype)  # [block_m, block_k]
        w = w_ref[e, kb].astype(dtype)  # [block_k, block_n]
        part = jnp.dot(x, w, preferred_element_type=jnp.float32)
        if steps:  # the one scale of this K block and column block
            part = part * s_ref[e, kb // steps[0], j // steps[1]]
        return acc + part

    o_ref[...] = jnp.zeros(o_ref.shape, o_ref.dtype)

    @pl.when(n > 0)  # an empty item reads no weights (static loop bounds: JAX 0.11's Triton
    def _():  # lowering rejects scf.for bounds of mixed integer types)
        acc = lax.fori_loop(0, nk, body, jnp.zeros(o_ref.shape, jnp.float32))
        o_ref[...] = acc.astype(o_ref.dtype)


@functools.partial(
    jax.jit,
    static_argnames=(
        "out_dtype",
        "block_m",
        "block_k",
        "block_n",
        "steps",
        "num_warps",
        "num_stages",
        "interpret",
    ),
)
def _grouped(
    xs,
    w,
    sizes,
    scale,
    *,
    out_dtype,
    block_m,
    block_k,
    block_n,
    steps,
    num_warps,
    num_stages,
    interpret,
):
    """`grouped_gemm` with its knobs checked; ``scale`` None, or f32[E, I/bi, O/bo] with
    ``steps`` (bi / block_k, bo / block_n)."""
    (M, I), (E, _, O) = xs.shape, w.shape
    nk = I // block_k
    expert, first, rows, item, offset = work_items(sizes, M, block_m)
    W = expert.shape[0]
    kernel = functools.partial(_kernel, block_m=block_m, nk=nk, M=M, dtype=xs.dtype, steps=steps)
    scales = [] if scale is None else [scale]
    tiles = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((W, block_m, O), out_dtype),
        grid=(W, O // block_n),
        in_specs=[
            pl.BlockSpec((W,), lambda i, j: (0,)),
            pl.BlockSpec((W,), lambda i, j: (0,)),
            pl.BlockSpec((W,), lambda i, j: (0,)),
            pl.BlockSpec((M, nk, block_k), lambda i, j: (0, 0, 0)),
            pl.BlockSpec((E, nk, block_k, block_n), lambda i, j: (0, 0, 0, j)),
            *(pl.BlockSpec(s.shape, lambda i, j: (0, 0, 0)) for s in scales),
        ],
        out_specs=pl.BlockSpec((None, block_m, block_n), lambda i, j: (i, 0, j)),
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        name=f"moe_gemm_m{block_m}_k{block_k}_n{block_n}" + ("_scaled" if steps else ""),
    )(expert, first, rows, xs.reshape(M, nk, block_k), w.reshape(E, nk, block_k, O), *scales)
    return tiles[item, offset]


def _tiles(I: int, O: int, block, block_m: int, block_k, block_n) -> tuple[int, int]:
    """(block_k, block_n): given or `default_blocks`; ValueError unless each of them and
    ``block_m`` is a power of 2 >= `MIN_BLOCK`, block_k dividing I, block_n O (and with scale
    ``block`` (bo, bi): bi, bo)."""
    auto_k, auto_n = default_blocks(I, O, block)
    block_k, block_n = block_k or auto_k, block_n or auto_n
    bo, bi = block or (O, I)
    for name, b, n in (
        ("block_m", block_m, None),
        ("block_k", block_k, math.gcd(I, bi)),
        ("block_n", block_n, math.gcd(O, bo)),
    ):
        if not (is_pow2(b) and b >= MIN_BLOCK and (n is None or n % b == 0)):
            raise ValueError(
                f"{name}={b} must be a power of 2 >= {MIN_BLOCK}"
                + (f" dividing {n}" if n is not None else "")
                + (" (gcd of the size and the scale block)" if block and n is not None else "")
            )
    return block_k, block_n


def grouped_gemm(
    xs: jax.Array,
    w: jax.Array,
    sizes: jax.Array,
    *,
    scale: jax.Array | None = None,
    block: tuple[int, int] | None = None,
    preferred_element_type=None,
    interpret: bool = False,
    block_m: int = 16,
    block_k: int | None = None,
    block_n: int | None = None,
    num_warps: int = 4,
    num_stages: int = 3,
) -> jax.Array:
    """``jax.lax.ragged_dot(xs, w, sizes)``: xs [M, I] sorted by group (bf16/f16/f32), w [E, I, O]
    (xs's dtype, or float8_e4m3fn converted to xs's dtype in the kernel), sizes i32[E] summing
    to M -> [M, O] in ``preferred_element_type`` (default xs's dtype), f32 accumulation. With
    ``scale`` f32[E, ceil(I/bi), ceil(O/bo)] of HF FP8 blocks ``block`` (bo, bi) (`weights.
    scale_shape`; edge blocks partial): the product with w's values times their block's scale,
    each K block's f32 partial product scaled before it is added. Knobs: ``block_m`` rows a tile
    (a power of 2 >= 16), ``block_k`` / ``block_n`` (default `default_blocks`; with ``block``
    they must divide bi / bo). ValueError: shapes or knobs not as stated."""
    (M, I), E = xs.shape, sizes.shape[0]
    if w.ndim != 3 or w.shape[:2] != (E, I):
        raise ValueError(f"w must be [E={E}, I={I}, O]; got shape {w.shape}")
    O, (bo, bi) = w.shape[2], block or (None, None)
    block_k, block_n = _tiles(I, O, block, block_m, block_k, block_n)
    want = block and (E, -(-I // bi), -(-O // bo))
    if (got := None if scale is None else tuple(scale.shape)) != want:
        raise ValueError(
            f"scale must be {want and f'f32{list(want)}'} for block={block}; got {got}"
        )
    steps = block and (bi // block_k, bo // block_n)
    if M == 0:
        return jnp.zeros((0, O), preferred_element_type or xs.dtype)
    return _grouped(
        xs,
        w,
        sizes.astype(jnp.int32),
        None if scale is None else scale.astype(jnp.float32),
        out_dtype=jnp.dtype(preferred_element_type or xs.dtype),
        block_m=block_m,
        block_k=block_k,
        block_n=block_n,
        steps=steps,
        num_warps=num_warps,
        num_stages=num_stages,
        interpret=bool(interpret),
    )
