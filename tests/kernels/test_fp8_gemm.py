"""`pallas_kernels.fp8_gemm.fp8_matmul` against its float32 reference: interpreted on small shapes
(rows 1, 5 and 16 padded to the MMA's 16, split_k 1 and 2, several K chunks per program), compiled
on the GPU at Qwen3-8B's decode shapes with the default knobs; argument errors. Its dispatch:
``KernelConfig.fp8_gemm`` -> `ModelKernels` -> each fp8 `Weight` -> `dense` (decode rows only).

Tolerance: the products of bf16 x and e4m3 w (exact in bf16) are exact in f32, so the kernel
differs from the f32 reference by f32 summation order (|err| <= K * 2^-24 * sum |x||w| * scale,
bounded by 1e-5 of it at these K) and by the one rounding of the output to bf16 (round to nearest:
|err| <= 2^-9 |y| for 8 significand bits, 2^-8 allowed)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tiny_model import TINY

from jaxinfer import models
from jaxinfer.config import EngineConfig, ModelConfig, resolve
from jaxinfer.models import layers
from jaxinfer.models.kernels import ModelKernels, model_kernels
from jaxinfer.models.kv_cache import KVCache
from pallas_kernels.fp8_gemm import (DECODE_MAX_ROWS, FP8, check_args, default_knobs, fp8_matmul,
                                     fp8_matmul_reference)

from .modes import ON_GPU


def case(M, K, N, seed=0):
    """x bf16[M, K] ~ N(0, 1); w e4m3 [K, N] over e4m3's range; per-channel scales."""
    k = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(k[0], (M, K), jnp.bfloat16)
    w = jnp.clip(jax.random.normal(k[1], (K, N)) * 100, -448, 448).astype(FP8)
    scale = jax.random.uniform(k[2], (N,), minval=1e-3, maxval=1e-2)
    return x, w, scale


def assert_matches_reference(y, x, w, scale):
    want = np.asarray(fp8_matmul_reference(x, w, scale), np.float64)
    xf, wf = (np.asarray(a.astype(jnp.float32), np.float64) for a in (x, w))
    mag = np.abs(xf) @ np.abs(wf) * np.asarray(scale)[None]           # sum |x||w| * scale
    assert y.dtype == jnp.bfloat16 and y.shape == want.shape
    err = np.abs(np.asarray(y, np.float64) - want)
    assert np.all(err <= 2.0 ** -8 * np.abs(want) + 1e-5 * mag), float((err / mag).max())


@pytest.mark.parametrize("M", [1, 5, 16])
@pytest.mark.parametrize("split_k", [1, 2])
def test_interpret_matches_reference(M, split_k):
    x, w, scale = case(M, 256, 256, seed=M)
    y = fp8_matmul(x, w, scale, block_n=128, block_k=64, split_k=split_k, num_warps=4,
                   num_stages=3, interpret=True)
    assert_matches_reference(y, x, w, scale)


@pytest.mark.parametrize("M,K,N", [(1, 4096, 6144), (1, 12288, 4096), (64, 4096, 24576),
                                   (64, 4096, 4096), (256, 12288, 4096), (3, 96, 48)])
def test_default_knobs_are_valid(M, K, N):
    knobs = default_knobs(M, K, N)
    x, w, scale = (jax.ShapeDtypeStruct(s, d) for s, d in (
        ((M, K), jnp.bfloat16), ((K, N), FP8), ((N,), jnp.float32)))
    assert check_args(x, w, scale, **knobs) == (M, K, N)


@pytest.mark.parametrize("change,match", [
    (dict(x=((1, 256), jnp.float32)), "x must be bfloat16"),
    (dict(x=((256,), jnp.bfloat16)), r"x must be bfloat16 \[M, K\]"),
    (dict(w=((256, 256), jnp.bfloat16)), "w must be float8_e4m3fn"),
    (dict(x=((1, 128), jnp.bfloat16)), "disagree on K"),
    (dict(scale=((256,), jnp.bfloat16)), "scale must be float32"),
    (dict(scale=((128,), jnp.float32)), r"scale must be float32 \[N=256\]"),
    (dict(block_n=96), "block_n=96 must be a power of 2"),
    (dict(block_k=8), "block_k=8 must be a power of 2 >= 16"),
    (dict(split_k=0), "split_k=0"),
    (dict(block_n=512), "N=256 must be a multiple of block_n=512"),
    (dict(split_k=3), r"K=256 must be a multiple of split_k \* block_k = 3 \* 64"),
    (dict(num_warps=3), "num_warps=3"),
    (dict(num_stages=0), "num_stages=0"),
])
def test_bad_arguments_raise(change, match):
    arrays = dict(x=((1, 256), jnp.bfloat16), w=((256, 256), FP8), scale=((256,), jnp.float32))
    arrays.update({k: v for k, v in change.items() if k in arrays})
    x, w, scale = (jnp.zeros(s, d) for s, d in arrays.values())
    knobs = dict(block_n=128, block_k=64, split_k=1, num_warps=4, num_stages=3)
    knobs.update({k: v for k, v in change.items() if k not in arrays})
    with pytest.raises(ValueError, match=match):
        fp8_matmul(x, w, scale, interpret=True, **knobs)


@pytest.mark.parametrize("M", [1, 64])
@pytest.mark.parametrize("K,N", [(4096, 6144), (12288, 4096)])  # Qwen3-8B wqkv, down
@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
def test_compiled_qwen3_8b_shapes(M, K, N):
    x, w, scale = case(M, K, N)
    assert_matches_reference(jax.block_until_ready(fp8_matmul(x, w, scale)), x, w, scale)


@pytest.fixture
def kernel_calls(monkeypatch):
    """The x shapes `dense` hands `fp8_matmul`, which runs interpreted."""
    calls = []

    def interpreted(x, w, scale):
        calls.append(x.shape)
        return fp8_matmul(x, w, scale, interpret=True)
    monkeypatch.setattr(layers, "fp8_matmul", interpreted)
    return calls


def test_dense_runs_decode_rows_of_bf16_through_the_kernel(kernel_calls):
    x, w, scale = case(2, 256, 256)
    y = layers.dense(x.reshape(1, 2, 256), layers.Weight(w, scale, None, "triton"))
    assert kernel_calls == [(2, 256)] and y.shape == (1, 2, 256)
    assert_matches_reference(y[0], x, w, scale)
    for x in (jnp.zeros((1, DECODE_MAX_ROWS + 1, 256), jnp.bfloat16), x.astype(jnp.float32)):
        layers.dense(x, layers.Weight(w, scale, None, "triton"))     # XLA's dot
    layers.dense(x, layers.Weight(w, scale))
    assert len(kernel_calls) == 1


def test_fp8_gemm_choice_reaches_every_fp8_matrix_of_the_model(kernel_calls):
    cfg = ModelConfig(**TINY)
    spec = "decode=reference,prefill=reference,fp8_gemm=triton"
    kc = resolve(cfg, EngineConfig(kernels=spec), "gpu").kernels
    kernels = model_kernels(kc)
    assert kernels == ModelKernels(fp8_gemm="triton")
    params = models.abstract_params(cfg, jnp.bfloat16, "fp8")
    pool = jax.ShapeDtypeStruct((cfg.num_layers, 2, cfg.num_kv_heads, 16, cfg.head_dim),
                                jnp.bfloat16)
    i32 = jax.ShapeDtypeStruct((3, 1), jnp.int32)
    kv = KVCache(pool, pool, i32, jax.ShapeDtypeStruct((3,), jnp.int32))
    jax.eval_shape(lambda p, kv: models.forward(p, cfg, kv.block_tables, kv.block_tables,
                                                kv.block_tables, kv, kernels=kernels), params, kv)
    assert len(kernel_calls) == 4 * cfg.num_layers                    # wqkv, wo, gate_up, down
    assert {s[0] for s in kernel_calls} == {3}


@pytest.mark.parametrize("platform,tp", [("cpu", 1), ("gpu", 2)])
def test_fp8_gemm_triton_needs_one_gpu(platform, tp):
    with pytest.raises(ValueError, match="fp8_gemm='triton' is invalid: runs on one GPU only"):
        resolve(ModelConfig(**TINY), EngineConfig(kernels="fp8_gemm=triton",
                                                  tensor_parallel_size=tp), platform)
