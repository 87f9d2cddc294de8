"""The fused producers of W8A8 GEMM inputs (`pallas_kernels.act_quant`) against the engine's jnp
code: `layers.add_rms_norm` / the SwiGLU product of `layers.mlp`, then `quantize.quantize_tokens`.
Rows of zeros (scale 1), a row with one large outlier, row counts 1, odd and larger than a program,
rows read in several chunks (D = 384: three of 128), bf16 and f32.

Both sides are compiled with XLA's excess precision off (`strict`): jitted, XLA may otherwise skip
the roundings to bf16 between ops that the jnp code writes and the kernel does. Interpreted (CPU),
the kernel body is that jnp code: e4m3 bits and scales equal, but for the f32 norm, where the
order of the sum of squares (per chunk, per row block) shows in the last bit of the scale.
Compiled (``-m gpu``; Qwen3-8B D = 4096, F = 12288, M up to 2048), Triton's f32 summation order,
rsqrt, exp and division may differ from XLA's in the last bit: each e4m3 value within one e4m3
step, at most 1% of them apart, scales within 2^-7 (one bf16 step of the amax). The kernels'
Triton lowering is checked on the CPU too (`lower` for CUDA, no compile)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.models.layers import add_rms_norm
from jaxinfer.models.quantize import quantize_tokens
from pallas_kernels.act_quant import add_rms_norm_quant, silu_mul_quant

from .modes import runs

EPS = 1e-6
F32, BF16 = jnp.float32, jnp.bfloat16
strict = functools.partial(jax.jit, compiler_options={"xla_allow_excess_precision": False})


def norm_ref(x, delta, w):
    """The engine's residual add and RMSNorm, then its per-token quantisation."""
    total, h = add_rms_norm(x, delta, w, eps=EPS)
    return (total, *quantize_tokens(h))


def silu_ref(gate_up):
    """`layers.mlp`'s SwiGLU product (shards 1), then its per-token quantisation."""
    gu = gate_up.reshape(*gate_up.shape[:-1], 1, 2, -1)
    h = (jax.nn.silu(gu[..., 0, :]) * gu[..., 1, :]).reshape(*gate_up.shape[:-1], -1)
    return quantize_tokens(h)


def rows(shape, dtype, seed, scale=3.0):
    """Random [..., n] rows; with more than one row, the first all zeros and one element of the
    second 1000 times the others."""
    x = np.random.default_rng(seed).standard_normal(shape).astype(np.float32) * scale
    flat = x.reshape(-1, shape[-1])
    if flat.shape[0] > 1:
        flat[0] = 0
        flat[1, 7] = 1000 * scale
    return jnp.asarray(x, dtype)


def assert_quantized_equal(got, want, rtol=None):
    """(e4m3, f32 scale) pairs: the same bits, or (``rtol``) each value within one e4m3 step
    (3 mantissa bits; 2^-9 below the normal range), at most 1% apart, scales within ``rtol``."""
    (q, s), (q2, s2) = got, want
    assert q.shape == q2.shape and q.dtype == q2.dtype and s.shape == s2.shape == (*q.shape[:-1], 1)
    if rtol is None:
        np.testing.assert_array_equal(np.asarray(q.view(jnp.uint8)), np.asarray(q2.view(jnp.uint8)))
        np.testing.assert_array_equal(np.asarray(s), np.asarray(s2))
        return
    a, b = np.asarray(q, np.float32), np.asarray(q2, np.float32)
    big = np.maximum(np.abs(a), np.abs(b))
    step = np.where(big >= 2.0**-6, 2.0 ** (np.floor(np.log2(np.maximum(big, 2.0**-6))) - 3), 2**-9)
    assert np.all(np.abs(a - b) <= step), "an e4m3 value more than one step apart"
    assert np.mean(a != b) <= 0.01
    np.testing.assert_allclose(np.asarray(s), np.asarray(s2), rtol=rtol)


NORM_CASES = [  # (x shape, dtype, with delta, block_m)
    ((1, 256), BF16, True, 1),
    ((1, 5, 384), F32, True, 1),  # [B, T, D], three chunks of 128
    ((5, 256), BF16, False, 4),  # 5 rows: one a program
    ((64, 512), BF16, True, 4),
    ((64, 256), F32, True, 1),
]
NORM_GPU = [((M, 4096), BF16, True, bm) for M, bm in ((1, 1), (16, 1), (256, 2), (2048, 1))]


@pytest.mark.parametrize("mode, case", runs(NORM_CASES, gpu_cases=NORM_GPU))
def test_add_rms_norm_quant_equals_the_engine_code(mode, case):
    shape, dtype, with_delta, block_m = case
    x, w = rows(shape, dtype, 0), rows(shape[-1:], dtype, 1, 0.2) + 1
    delta = rows(shape, dtype, 2) if with_delta else None
    kernel = functools.partial(
        add_rms_norm_quant, eps=EPS, interpret=mode == "interpret", block_m=block_m
    )
    got, want = strict(kernel)(x, delta, w), strict(norm_ref)(x, delta, w)
    np.testing.assert_array_equal(np.asarray(got[0], np.float32), np.asarray(want[0], np.float32))
    rtol = 2**-7 if mode == "compiled" else 2**-20 if dtype == F32 else None
    assert_quantized_equal(got[1:], want[1:], rtol)
    if len(x.reshape(-1, shape[-1])) > 1:  # the row of zeros
        assert (
            float(got[2].reshape(-1)[0]) == 1.0
            and not np.asarray(got[1], np.float32).reshape(-1, shape[-1])[0].any()
        )


SILU_CASES = [  # (gate_up shape, dtype, block_m)
    ((1, 512), F32, 1),
    ((5, 768), BF16, 1),  # F = 384: three chunks
    ((64, 1024), BF16, 4),
    ((2, 32, 512), F32, 2),
]
SILU_GPU = [((M, 2 * 12288), BF16, 1) for M in (1, 16, 256, 2048)]


@pytest.mark.parametrize("mode, case", runs(SILU_CASES, gpu_cases=SILU_GPU))
def test_silu_mul_quant_equals_the_engine_code(mode, case):
    shape, dtype, block_m = case
    gate_up = rows(shape, dtype, 3, 2.0)
    kernel = functools.partial(silu_mul_quant, interpret=mode == "interpret", block_m=block_m)
    got, want = strict(kernel)(gate_up), strict(silu_ref)(gate_up)
    assert_quantized_equal(got, want, 2**-7 if mode == "compiled" else None)
    if len(gate_up.reshape(-1, shape[-1])) > 1:  # silu(0) * 0: a row of zeros
        assert (
            float(got[1].reshape(-1)[0]) == 1.0
            and not np.asarray(got[0], np.float32).reshape(-1, shape[-1] // 2)[0].any()
        )


def test_kernels_lower_to_triton():
    """Qwen3-8B sizes (F = 12288: three chunks) and a D read in five chunks (5120) lower to
    Triton for a GPU: every op in the kernels has a Triton lowering (checked without a GPU)."""
    S = jax.ShapeDtypeStruct
    norm = functools.partial(add_rms_norm_quant, eps=EPS, block_m=2)
    lowered = [
        jax.jit(norm).trace(S((4, 4096), BF16), S((4, 4096), BF16), S((4096,), BF16)),
        jax.jit(lambda x, w: norm(x, None, w)).trace(S((3, 5120), F32), S((5120,), F32)),
        jax.jit(silu_mul_quant).trace(S((4, 2 * 12288), BF16)),
    ]
    for t in lowered:
        assert "triton" in t.lower(lowering_platforms=("cuda",)).as_text()


def test_bad_shapes_and_knobs_are_named_and_no_rows_is_empty():
    x, w = jnp.zeros((4, 256), BF16), jnp.ones((256,), BF16)
    with pytest.raises(ValueError, match=r"w must be \[D=256\]"):
        add_rms_norm_quant(x, None, jnp.ones((128,)), eps=EPS)
    with pytest.raises(ValueError, match="delta must be float of x's shape"):
        add_rms_norm_quant(x, jnp.zeros((4, 128)), w, eps=EPS)
    with pytest.raises(ValueError, match="block_m=3 must be a power of 2"):
        add_rms_norm_quant(x, None, w, eps=EPS, block_m=3)
    with pytest.raises(ValueError, match="D=257 must be a positive multiple"):
        add_rms_norm_quant(jnp.zeros((4, 257)), None, jnp.ones((257,)), eps=EPS)
    with pytest.raises(ValueError, match="gate_up must be float"):
        silu_mul_quant(jnp.zeros((4, 255)))
    with pytest.raises(ValueError, match="F=65536 must be <= 32768"):
        silu_mul_quant(jnp.zeros((1, 2 * 65536), BF16))
    total, q, s = add_rms_norm_quant(jnp.zeros((0, 256), BF16), None, w, eps=EPS)
    assert total.shape == q.shape == (0, 256) and s.shape == (0, 1)
    q, s = silu_mul_quant(jnp.zeros((2, 0, 512)))
    assert q.shape == (2, 0, 256) and s.shape == (2, 0, 1)
