"""The mixture-of-experts grouped GEMM (`pallas_kernels.moe_gemm`) against a float64 numpy loop
over the groups: empty experts, one row, groups longer than a tile, every row in one expert,
fp8 weights; interpret mode on the CPU, compiled on a GPU (``-m gpu``, with a Qwen3-30B-A3B
expert shape). Its work items are checked on their own: every row in exactly one tile."""

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
