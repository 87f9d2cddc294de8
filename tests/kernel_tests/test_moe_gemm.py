"""The mixture-of-experts grouped GEMM (`pallas_kernels.moe_gemm`) against a float64 numpy loop
over the groups: empty experts, one row, groups longer than a tile, every row in one expert,
fp8 weights, HF FP8 block scales (partial edge blocks too); interpret mode on the CPU, compiled
on a GPU (``-m gpu``, with Qwen3-30B-A3B expert shapes). Its work items are checked on their
own: every row in exactly one tile."""

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from pallas_kernels.moe_gemm import grouped_gemm, work_items

from .modes import runs


def _oracle(xs, w, sizes) -> np.ndarray:
    """float64: row r times the matrix of the group it falls in."""
    xs, w = np.asarray(xs, np.float64), np.asarray(w.astype(jnp.float32), np.float64)
    out, r = np.zeros((xs.shape[0], w.shape[2])), 0
    for e, n in enumerate(np.asarray(sizes)):
        out[r : r + n] = xs[r : r + n] @ w[e]
        r += n
    return out


CASES = [  # (sizes, I, O)
    ((0, 2, 2, 0, 0, 2, 1, 1), 64, 32),
    ((1,), 32, 16),
    ((0, 0, 40, 0), 128, 64),  # one group over three tiles of 16
    ((3, 17, 0, 16, 1, 0, 0, 5), 48, 80),  # I, O not powers of 2 (blocks of 16)
]


@pytest.mark.parametrize("mode, case", runs(CASES, gpu_cases=[((2,) * 64 + (0,) * 64, 2048, 1536)]))
def test_grouped_gemm_matches_numpy(mode, case):
    sizes, I, O = case
    E, M = len(sizes), sum(sizes)
    rng = np.random.default_rng(M)
    dtype = jnp.float32 if mode == "interpret" else jnp.bfloat16
    xs = jnp.asarray(rng.standard_normal((M, I)), dtype)
    w = jnp.asarray(rng.standard_normal((E, I, O)) / np.sqrt(I), dtype)
    out = grouped_gemm(xs, w, jnp.asarray(sizes), interpret=mode == "interpret")
    tol = 1e-5 if dtype == jnp.float32 else 3e-2
    assert out.shape == (M, O) and out.dtype == dtype
    np.testing.assert_allclose(np.asarray(out, np.float64), _oracle(xs, w, sizes), atol=tol)


@pytest.mark.parametrize("mode, case", runs([((2, 0, 5, 1), 64, 32)]))
def test_fp8_weights_are_converted_in_the_kernel(mode, case):
    """e4m3 weights (exact in bf16 and f32) give the product of their values, f32 accumulated
    when asked (``preferred_element_type``)."""
    sizes, I, O = case
    rng = np.random.default_rng(1)
    dtype = jnp.float32 if mode == "interpret" else jnp.bfloat16
    xs = jnp.asarray(rng.standard_normal((sum(sizes), I)), dtype)
    w8 = jnp.asarray((rng.standard_normal((len(sizes), I, O)) / 4).astype(ml_dtypes.float8_e4m3fn))
    out = grouped_gemm(
        xs,
        w8,
        jnp.asarray(sizes),
        preferred_element_type=jnp.float32,
        interpret=mode == "interpret",
    )
    assert out.dtype == jnp.float32
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    np.testing.assert_allclose(np.asarray(out, np.float64), _oracle(xs, w8, sizes), atol=tol)


BLOCK_CASES = [  # (sizes, I, O, HF scale block (bo, bi))
    ((2, 0, 5, 1, 17), 80, 48, (16, 32)),  # the last K block partial (80 = 2.5 x 32)
    ((3, 1, 0, 20), 48, 80, (32, 16)),  # the last column block partial (80 = 2.5 x 32)
]


@pytest.mark.parametrize(
    "mode, case",
    runs(BLOCK_CASES, gpu_cases=[((2,) * 64 + (0,) * 64, 2048, 1536, (128, 128))]),
)
def test_block_scaled_fp8_weights(mode, case):
    """HF FP8 block scales f32[E, ceil(I/bi), ceil(O/bo)], each block's its own: the product
    with every e4m3 value times its block's scale (numpy's dequantised stack)."""
    sizes, I, O, (bo, bi) = case
    E, M = len(sizes), sum(sizes)
    rng = np.random.default_rng(M)
    dtype = jnp.float32 if mode == "interpret" else jnp.bfloat16
    xs = jnp.asarray(rng.standard_normal((M, I)), dtype)
    w8 = (rng.standard_normal((E, I, O)) * 4).astype(ml_dtypes.float8_e4m3fn)
    scale = rng.uniform(0.5, 2.0, (E, -(-I // bi), -(-O // bo))).astype(np.float32) / (4 * I**0.5)
    expanded = np.repeat(np.repeat(scale, bi, 1), bo, 2)[:, :I, :O]
    out = grouped_gemm(
        xs,
        jnp.asarray(w8),
        jnp.asarray(sizes),
        scale=jnp.asarray(scale),
        block=(bo, bi),
        preferred_element_type=jnp.float32,
        interpret=mode == "interpret",
    )
    want = _oracle(xs, w8.astype(np.float32) * expanded, sizes)
    assert out.shape == (M, O) and out.dtype == jnp.float32
    np.testing.assert_allclose(
        np.asarray(out, np.float64), want, atol=1e-5 if mode == "interpret" else 1e-3
    )


def test_block_scaled_kernel_lowers_to_triton():
    """Qwen3-30B-A3B-FP8's gate|up stacks (E = 128, blocks of 128) lower to Triton for a GPU:
    the scale loads inside the K loop have a Triton lowering (checked without a GPU)."""
    S = jax.ShapeDtypeStruct
    gemm = functools.partial(grouped_gemm, block=(128, 128), preferred_element_type=jnp.float32)
    traced = jax.jit(lambda xs, w, s, sizes: gemm(xs, w, sizes, scale=s)).trace(
        S((64, 2048), jnp.bfloat16),
        S((128, 2048, 1536), jnp.float8_e4m3fn),
        S((128, 16, 12), jnp.float32),
        S((128,), jnp.int32),
    )
    assert "moe_gemm_m16_k64_n64_scaled" in traced.lower(lowering_platforms=("cuda",)).as_text()


def test_work_items_cover_every_row_once():
    rng = np.random.default_rng(0)
    for _ in range(20):
        E, block_m = int(rng.integers(1, 12)), 16
        sizes = rng.integers(0, 40, E) * (rng.random(E) < 0.6)
        M = int(sizes.sum())
        if M == 0:
            continue
        expert, first, rows, item, offset = map(
            np.asarray, work_items(jnp.asarray(sizes, jnp.int32), M, block_m)
        )
        assert len(expert) == -(-M // block_m) + min(E, M)
        starts = np.cumsum(sizes) - sizes
        for r in range(M):  # row r sits at (item, offset) of a tile of its own expert
            i = item[r]
            assert first[i] + offset[r] == r and offset[r] < rows[i]
            assert starts[expert[i]] <= r < starts[expert[i]] + sizes[expert[i]]
        assert rows.sum() == M  # tiles cover the rows exactly once


def test_bad_knobs_and_shapes_are_named():
    xs, w, sizes = jnp.zeros((4, 32)), jnp.zeros((2, 32, 16)), jnp.array([2, 2])
    with pytest.raises(ValueError, match="block_m=24 must be a power of 2"):
        grouped_gemm(xs, w, sizes, block_m=24)
    with pytest.raises(ValueError, match="w must be"):
        grouped_gemm(xs, jnp.zeros((3, 32, 16)), sizes)
    assert grouped_gemm(jnp.zeros((0, 32)), w, jnp.array([0, 0])).shape == (0, 16)
    with pytest.raises(ValueError, match=r"scale must be f32\[2, 1, 1\] for block=\(16, 32\)"):
        grouped_gemm(xs, w, sizes, scale=jnp.ones((2, 2, 1)), block=(16, 32))
    with pytest.raises(ValueError, match=r"block_k=32 must be .* dividing 16 \(gcd of the size"):
        grouped_gemm(xs, w, sizes, scale=jnp.ones((2, 2, 1)), block=(16, 16), block_k=32)
