"""fp8 KV pages (`pallas_kernels.kv_quant`): `quantize` against numpy's float8_e4m3fn rounding
(ml_dtypes; the model's page write: tests/models/test_fp8_kv.py), and the dequantising reads
(the reference, the Triton decode and prefill kernels) against float32 attention over the
dequantised pages ``stored.astype(f32) * scale``.

Tolerances: every read dequantises the same fp8 pages, so the only differences are float32
rounding (summation order, the scales folded into the logit scale and the output): 1e-5 relative
in float32, as the unquantised kernel suites; bf16 queries 1e-2 (their own rounding). A write
rounds x / scale to e4m3 (3 mantissa bits), relative error <= 2^-4 inside the normal range."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from pallas_kernels.kv_quant import FP8, FP8_MAX, quantize
from pallas_kernels.paged_attention import prefill_triton, reference, triton_pallas

from .modes import runs


def np_fp8(x, scale):
    """Independent oracle of a write: numpy's round-to-nearest-even cast to e4m3 of x / scale."""
    y = np.clip(np.asarray(x, np.float32) / np.asarray(scale, np.float32), -FP8_MAX, FP8_MAX)
    return y.astype(ml_dtypes.float8_e4m3fn)


def fp8_case(seed, *, L=2, K=2, ps=16, H=64, N=4, lens=(1, 15, 16, 17, 64, 0), qdt="float32"):
    """Random pools (scaled so that ``x / scale`` spans e4m3's range) quantised with random
    per-head scales, a permuted table, ragged lengths -> (q, kq, vq, bt, lens, ks, vs, dequantised
    k, dequantised v)."""
    rng = np.random.default_rng(seed)
    B, M = len(lens), max(-(-max(lens) // ps), 1)
    P = B * M + 2
    ks, vs = (rng.uniform(0.002, 0.05, (L, K)).astype(np.float32) for _ in range(2))
    pools = rng.standard_normal((2, L, P, K, ps, H)).astype(np.float32) * 3
    kq, vq = (np_fp8(p, s[:, None, :, None, None]) for p, s in zip(pools, (ks, vs)))
    deq = [x.astype(np.float32) * s[:, None, :, None, None] for x, s in ((kq, ks), (vq, vs))]
    bt = rng.permutation(np.arange(1, P))[: B * M].reshape(B, M).astype(np.int32)
    q = jnp.asarray(rng.standard_normal((B, N, H)), jnp.dtype(qdt))
    return (
        q,
        jnp.asarray(kq),
        jnp.asarray(vq),
        jnp.asarray(bt),
        jnp.asarray(np.array(lens, np.int32)),
        jnp.asarray(ks),
        jnp.asarray(vs),
        jnp.asarray(deq[0]),
        jnp.asarray(deq[1]),
    )


def assert_close(out, ref, tol):
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    assert np.all(np.isfinite(out))
    rel = np.linalg.norm(out - ref) / np.linalg.norm(ref)
    assert rel < tol, f"relative error {rel:.2e} >= {tol}"
    np.testing.assert_allclose(out, ref, rtol=tol, atol=4 * tol)


def test_quantize_matches_numpy_e4m3_and_clips():
    x = np.concatenate(
        [np.random.default_rng(0).standard_normal(1000) * 50, [1e4, -1e4, 0.0, 1e-4]]
    ).astype(np.float32)
    got = np.asarray(quantize(jnp.asarray(x), jnp.float32(0.25), FP8)).astype(np.float32)
    np.testing.assert_array_equal(got, np_fp8(x, 0.25).astype(np.float32))
    assert got.max() == FP8_MAX and got.min() == -FP8_MAX  # clipped, never NaN
    normal = (np.abs(x / 0.25) >= 2.0**-6) & (np.abs(x / 0.25) <= FP8_MAX)
    rel = np.abs(got * 0.25 - x)[normal] / np.abs(x[normal])
    assert rel.max() <= 2.0**-4 and rel.max() > 2.0**-7  # e4m3's half ulp is used
    np.testing.assert_array_equal(np.asarray(quantize(jnp.asarray(x), None, jnp.float32)), x)
    with pytest.raises(ValueError, match="fp8 KV pool needs"):
        quantize(jnp.asarray(x), None, FP8)


def test_reference_dequantises_with_per_head_scales():
    q, kq, vq, bt, lens, ks, vs, kd, vd = fp8_case(0)
    with jax.default_matmul_precision("highest"):
        out = reference.paged_decode_attention(
            q, kq, vq, bt, lens, layer=1, scale=0.125, k_scale=ks, v_scale=vs
        )
        ref = reference.paged_decode_attention(q, kd, vd, bt, lens, layer=1, scale=0.125)
    assert_close(out, ref, 1e-6)


DECODE = [  # (H, N, K, q dtype, k_splits, soft_cap)
    (64, 4, 2, "float32", 1, None),
    (128, 8, 1, "float32", 3, None),
    (64, 8, 2, "bfloat16", 2, 5.0),
]


@pytest.mark.parametrize("mode, case", runs(DECODE))
def test_triton_decode_reads_fp8_pages(mode, case):
    H, N, K, qdt, splits, cap = case
    q, kq, vq, bt, lens, ks, vs, kd, vd = fp8_case(2, H=H, N=N, K=K, qdt=qdt)
    kw = dict(layer=1, scale=H**-0.5, soft_cap=cap)
    out = triton_pallas.paged_decode_attention(
        q,
        kq,
        vq,
        bt,
        lens,
        **kw,
        k_scale=ks,
        v_scale=vs,
        k_splits=splits,
        pages_per_block=1,
        interpret=mode == "interpret",
    )
    with jax.default_matmul_precision("highest"):
        ref = reference.paged_decode_attention(q.astype(jnp.float32), kd, vd, bt, lens, **kw)
    assert_close(out, ref, 1e-5 if qdt == "float32" else 1e-2)
    assert not np.asarray(out)[np.asarray(lens) == 0].any()


@pytest.mark.parametrize("mode, case", runs([(64, 4, 2), (64, 6, 3)]))
def test_triton_prefill_reads_fp8_pages(mode, case):
    H, N, K = case
    q, kq, vq, bt, lens, ks, vs, kd, vd = fp8_case(3, H=H, N=N, K=K, lens=(40, 17, 5))
    T = 5
    pos = np.stack([np.arange(n - T, n) for n in np.asarray(lens)]).astype(np.int32)
    qt = jnp.asarray(np.random.default_rng(4).standard_normal((3, T, N, H)), jnp.float32)
    kw = dict(layer=0, scale=H**-0.5)
    out = prefill_triton.paged_prefill_attention(
        qt,
        kq,
        vq,
        bt,
        lens,
        jnp.asarray(pos),
        **kw,
        k_scale=ks,
        v_scale=vs,
        interpret=mode == "interpret",
    )
    with jax.default_matmul_precision("highest"):
        ref = reference.paged_attention(qt, kd, vd, bt, lens, jnp.asarray(pos), **kw)
    assert_close(out, ref, 1e-5)


def test_fp8_pools_need_scales():
    q, kq, vq, bt, lens, ks, vs, *_ = fp8_case(8)
    with pytest.raises(ValueError, match="k_scale=None: fp8 KV pools need"):
        triton_pallas.paged_decode_attention(q, kq, vq, bt, lens, scale=0.1, interpret=True)
    with pytest.raises(ValueError, match=r"v_scale must be f32\[L=2, K=2\]"):
        prefill_triton.paged_prefill_attention(
            q[:, None],
            kq,
            vq,
            bt,
            lens,
            lens[:, None] - 1,
            scale=0.1,
            k_scale=ks,
            v_scale=vs[0],
            interpret=True,
        )
