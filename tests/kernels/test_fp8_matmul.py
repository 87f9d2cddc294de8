"""The fp8-weight GEMM kernel against the float32 reference in two modes (`modes.py`: interpret on
the CPU, compiled on a CUDA GPU with ``-m gpu``), its argument checks, and the reference against
the engine's `dense` on a per-channel fp8 `Weight`."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.models.layers import Weight, dense
from pallas_kernels.fp8_matmul import reference, triton_pallas
from pallas_kernels.fp8_matmul.triton_pallas import Fp8MatmulConfig

from .modes import runs


def make_inputs(seed, M, K, N):
    ks = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(ks[0], (M, K), jnp.float32).astype(jnp.bfloat16)
    w = (16 * jax.random.normal(ks[1], (K, N), jnp.float32)).astype(jnp.float8_e4m3fn)
    return x, w, jax.random.uniform(ks[2], (N,), minval=1e-3, maxval=1e-2)


def rel_err(got, want):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert np.all(np.isfinite(got))
    return np.linalg.norm(got - want) / np.linalg.norm(want)


CASES = [  # (M, K, N, config or None: default_config)
    (1, 256, 128, None),                                                    # GEMV, split K
    (3, 256, 256, Fp8MatmulConfig(gemv_rows=4, splits=2, block_k=32)),      # GEMV, 3 rows
    (3, 128, 128, Fp8MatmulConfig(gemv_rows=0, block_m=16, block_k=32)),    # dot, padded rows
    (16, 256, 128, None),                                                   # dot, 16 rows
    (64, 128, 256, Fp8MatmulConfig(block_n=64, block_k=32, splits=2)),      # dot, split K
    (20, 128, 128, Fp8MatmulConfig(block_m=16, block_k=32, swap_ab=True)),  # w^T x^T, padded
]
# compiled only; three, so that the GPU tier stays inside one 10-minute call
QWEN3_8B = [(1, 4096, 6144, None), (16, 4096, 24576, None), (256, 12288, 4096, None)]


@pytest.mark.parametrize("mode, case", runs(CASES, QWEN3_8B))
def test_kernel_matches_reference(mode, case):
    M, K, N, cfg = case
    x, w, s = make_inputs(M + K, M, K, N)
    got = triton_pallas.fp8_matmul(x, w, s, config=cfg, interpret=mode == "interpret")
    assert got.shape == (M, N) and got.dtype == jnp.bfloat16
    assert rel_err(got, reference.fp8_matmul(x, w, s)) < 4e-3  # bf16 output: ~2e-3


def test_reference_is_the_engines_dense():
    x, w, s = make_inputs(0, 5, 64, 32)
    assert rel_err(reference.fp8_matmul(x, w, s), dense(x, Weight(w, s))) < 1e-2
    want = (np.asarray(x, np.float64) @ np.asarray(w.astype(jnp.float32), np.float64)) * s
    assert rel_err(reference.fp8_matmul(x, w, s), want) < 4e-3


def test_bad_arguments_are_named():
    x, w, s = make_inputs(0, 2, 128, 128)
    call = lambda *a, **kw: triton_pallas.fp8_matmul(*a, interpret=True, **kw)  # noqa: E731
    for args, match in [((x[None], w, s), r"x must be \[M, K\]"),
                        ((x, w[:64], s), r"w must be \[K=128, N\]"),
                        ((x, w.astype(jnp.bfloat16), s), "w must be float8_e4m3fn"),
                        ((x, w, s[:64]), r"scale must be float32\[N=128\]"),
                        ((x.astype(jnp.float32), w, s), "x must be bfloat16")]:
        with pytest.raises(ValueError, match=match):
            call(*args)
    with pytest.raises(ValueError, match="N=96 must be a multiple of block_n=128"):
        call(x, w[:, :96], s[:96], config=Fp8MatmulConfig())
    with pytest.raises(ValueError, match=r"K=128 must be a multiple of splits \* block_k = 4 \* 64"):
        call(x, w, s, config=Fp8MatmulConfig(splits=4))
    for knobs, match in [(dict(block_n=96), "block_n=96 must be a power of 2 >= 16"),
                         (dict(block_k=8), "block_k=8 must be"),
                         (dict(block_m=0), "block_m=0 must be"),
                         (dict(splits=0), "splits=0 must be >= 1"),
                         (dict(num_warps=3), "num_warps=3 must be"),
                         (dict(num_stages=0), "num_stages=0 must be"),
                         (dict(gemv_rows=17), "gemv_rows=17 must be in 0..16")]:
        with pytest.raises(ValueError, match=match):
            Fp8MatmulConfig(**knobs)
    with pytest.raises(TypeError):
        Fp8MatmulConfig(4)  # knobs are keyword-only


def test_zero_rows_and_default_knobs():
    x, w, s = make_inputs(0, 0, 128, 128)
    got = triton_pallas.fp8_matmul(x, w, s, interpret=True)
    assert got.shape == (0, 128) and got.dtype == jnp.bfloat16
    for M, K, N in [(1, 4096, 6144), (4, 12288, 4096), (64, 4096, 24576), (256, 4096, 6144)]:
        cfg = triton_pallas.default_config(M, K, N)
        assert N % cfg.block_n == 0 and K % (cfg.splits * cfg.block_k) == 0
