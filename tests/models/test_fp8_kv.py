"""The fp8 KV cache through the model and the engine: the model's page write (q/k RMSNorm, RoPE,
quantised K/V) against an independent float32 prologue rounded by numpy; the Triton prefill and
decode kernels (interpret mode) on fp8 pages against the model's jnp path on the same pages; the
fp8 model against its float32-KV run; the engine generating with ``kv_cache_dtype="fp8"``; the pool
holding twice the tokens of bfloat16 in the same memory."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer import LLM, SamplingParams, models
from jaxinfer.config import EngineConfig, ModelConfig, resolve
from jaxinfer.config.memory import GIB, engine_pool_pages
from jaxinfer.models.kernels import ModelKernels, model_kernels
from jaxinfer.models.kv_cache import KVCache, page_dtype, stored_dtype
from jaxinfer.models.layers import StepContext
from jaxinfer.models.llama import attention_heads
from pallas_kernels.kv_quant import FP8
from pallas_kernels.paged_attention import prefill_triton
from tests.kernel_tests.test_fp8_kv import np_fp8

from .test_model_kernels import PAGE, kernel_config
from .test_model_kernels import _cfg as tiny_cfg


@pytest.fixture(scope="module")
def model():
    cfg = tiny_cfg("qwen3")
    params = models.init_params(cfg, jax.random.key(1), jnp.float32)
    return cfg, jax.tree_util.tree_map(lambda p: p * 5.0 if p.ndim == 2 else p, params)


def run_steps(cfg, params, kv, mk):
    """A prefill chunk (rows of 5 and 3 new tokens after 6 and 0 cached) then one decode step
    -> (hidden of both steps, cache)."""
    tok = jnp.asarray(np.arange(10).reshape(2, 5) % cfg.vocab_size, jnp.int32)
    pos = jnp.asarray([[6, 7, 8, 9, 10], [0, 1, 2, 3, 3]], jnp.int32)  # row 1: 4 real
    slot = kv.block_tables[jnp.arange(2)[:, None], pos // PAGE] * PAGE + pos % PAGE
    slot = slot.at[1, 4].set(0)  # padding: null page
    fwd = jax.jit(functools.partial(models.forward, cfg=cfg, kernels=mk))
    h1, kv = fwd(
        params,
        tokens=tok,
        positions=pos,
        slot_mapping=slot,
        kv=kv.replace(seq_lens=jnp.asarray([11, 4], jnp.int32)),
    )
    pos2 = jnp.asarray([[11], [4]], jnp.int32)
    slot2 = kv.block_tables[jnp.arange(2)[:, None], pos2 // PAGE] * PAGE + pos2 % PAGE
    h2, kv = fwd(
        params,
        tokens=tok[:, :1],
        positions=pos2,
        slot_mapping=slot2,
        kv=kv.replace(seq_lens=jnp.asarray([12, 5], jnp.int32)),
    )
    return jnp.concatenate([h1[0], h1[1, :4], h2[:, 0]]), kv


def fresh_kv(cfg, dtype, scales=None, means=None):
    """Pools [L, 9, K, PAGE, H] (page 0 null) with the first 6 positions of row 0 random (the
    cached prefix, quantised as a write would: less ``means`` f32[L, K, H] if given), rows' pages
    permuted."""
    rng = np.random.default_rng(0)
    shape = (cfg.num_layers, 9, cfg.num_kv_heads, PAGE, cfg.head_dim)
    pools = [np.zeros(shape, np.float32) for _ in range(2)]
    pages = rng.permutation(np.arange(1, 9)).reshape(2, 4).astype(np.int32)
    for p in pools:
        for t in range(6):
            p[:, pages[0, t // PAGE], :, t % PAGE] = rng.standard_normal(shape[::2][1:]) * 0.3
    kv = KVCache(*(jnp.asarray(p) for p in pools), jnp.asarray(pages), jnp.zeros(2, jnp.int32))
    if scales is None:
        return kv
    zero = jnp.zeros((cfg.num_layers, cfg.num_kv_heads, cfg.head_dim))
    (ks, vs), (km, vm) = scales, (m[:, None, :, None] for m in means or (zero, zero))
    k, v = (
        jnp.clip((p - m) / s[:, None, :, None, None], -448, 448).astype(dtype)
        for p, s, m in ((kv.k, ks, km), (kv.v, vs, vm))
    )
    return kv.replace(k=k, v=v, k_scale=ks, v_scale=vs)


def f32_prologue(qkv, wq, wk, cos, sin, *, N, K, H, eps=1e-6):
    """Independent float32 oracle of the K/V a layer writes: qkv [B, T, (N + 2K) * H] -> k (HF
    RMSNorm by ``wk``, then ``rotate_half`` RoPE), v f32[B, T, K, H]."""
    heads = jnp.asarray(qkv, jnp.float32).reshape(*qkv.shape[:2], N + 2 * K, H)
    k, v = heads[:, :, N : N + K], heads[:, :, N + K :]
    k = k * jax.lax.rsqrt(jnp.mean(k * k, axis=-1, keepdims=True) + eps) * wk
    k1, k2 = k[..., : H // 2], k[..., H // 2 :]
    c, s = cos[:, :, None], sin[:, :, None]
    return jnp.concatenate([k1 * c - k2 * s, k2 * c + k1 * s], axis=-1), v


def test_model_writes_fp8_pages():
    """`attention_heads` into fp8 pools at layer 1 stores numpy's e4m3 rounding of the float32
    prologue's K/V less that layer's means (`KVCache.k_mean`, ``v_mean``) over its per-head
    scales: within one e4m3 step (float32 rounding may cross a rounding boundary), equal for
    nearly every element; nothing else written."""
    rng = np.random.default_rng(5)
    B, T, N, K, H, L, P, ps = 2, 3, 4, 2, 32, 2, 6, 8
    qkv = jnp.asarray(rng.standard_normal((B, T, (N + 2 * K) * H)), jnp.float32)
    wq, wk = (jnp.asarray(1 + 0.1 * rng.standard_normal(H), jnp.float32) for _ in range(2))
    ang = rng.integers(0, 4096, (B, T, 1)) * 10000.0 ** (-np.arange(0, H, 2) / H)
    cos, sin = jnp.asarray(np.cos(ang), jnp.float32), jnp.asarray(np.sin(ang), jnp.float32)
    slots = (rng.permutation((P - 1) * ps)[: B * T] + ps).reshape(B, T).astype(np.int32)  # no null
    ks, vs = (rng.uniform(0.005, 0.05, (L, K)).astype(np.float32) for _ in range(2))
    km, vm = (rng.uniform(-1, 1, (L, K, H)).astype(np.float32) for _ in range(2))
    zeros = jnp.zeros((L, P, K, ps, H), FP8)
    ctx = StepContext(
        jnp.zeros((B, T), jnp.int32),
        jnp.asarray(slots),
        jnp.zeros((B, 1), jnp.int32),
        jnp.zeros((B,), jnp.int32),
        cos,
        sin,
        k_scale=jnp.asarray(ks),
        v_scale=jnp.asarray(vs),
        k_mean=jnp.asarray(km),
        v_mean=jnp.asarray(vm),
    )
    _, kp, vp = attention_heads(
        qkv,
        zeros,
        zeros,
        ctx,
        wq,
        wk,
        kernels=ModelKernels(),
        layer=1,
        num_heads=N,
        num_kv_heads=K,
        eps=1e-6,
    )
    page, off = slots // ps, slots % ps
    for pool, want, s, m in zip(
        (kp, vp), f32_prologue(qkv, wq, wk, cos, sin, N=N, K=K, H=H), (ks, vs), (km, vm)
    ):
        assert pool.dtype == FP8
        want = np_fp8(np.asarray(want) - m[1], s[1][:, None])  # [B, T, K, H]
        got = np.asarray(pool).astype(np.float32)
        np.testing.assert_allclose(
            got[1, page, :, off], want.astype(np.float32), rtol=2.0**-3, atol=2.0**-9
        )
        assert np.mean(np.asarray(pool)[1, page, :, off] == want) > 0.99
        got[1, page, :, off] = 0
        assert not got.any()  # layer 0, other slots


@pytest.mark.parametrize("dtype", [FP8, jnp.bfloat16])
def test_pools_kept_as_integers_run_as_their_pages(model, dtype):
    """A CPU keeps bf16 and fp8 pools as uint16 and uint8 (`stored_dtype`): the model's steps on
    such pools give the same hidden states and the same page bits as on pools of ``dtype``."""
    cfg, params = model
    kv = fresh_kv(cfg, jnp.float32)
    scales = tuple(jnp.max(jnp.abs(p), axis=(1, 3, 4)) / 240.0 for p in (kv.k, kv.v))
    kv = (
        fresh_kv(cfg, FP8, scales)
        if dtype == FP8
        else kv.replace(k=kv.k.astype(dtype), v=kv.v.astype(dtype))
    )
    stored = stored_dtype(dtype, "cpu")
    assert stored.itemsize == jnp.dtype(dtype).itemsize and page_dtype(stored) == dtype
    h, got = run_steps(cfg, params, kv, ModelKernels())
    h_st, got_st = run_steps(
        cfg, params, kv.replace(k=kv.k.view(stored), v=kv.v.view(stored)), ModelKernels()
    )
    assert got_st.k.dtype == stored
    np.testing.assert_array_equal(np.asarray(h_st), np.asarray(h))
    for a, b in ((got_st.k, got.k), (got_st.v, got.v)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b).view(stored))


def test_triton_kernels_on_fp8_pages_match_the_jnp_path(model, monkeypatch):
    """Prefill and decode kernels (interpret) vs the jnp path on the same fp8 pages:
    identical inputs, so float32 rounding only (1e-4); and the fp8 model within 10% of
    its float32-KV run, with scales from that run's K/V amax (a scale applied wrongly is off by
    orders of magnitude)."""
    from jaxinfer.models import kernels

    cfg, params = model
    h32, kv32 = run_steps(cfg, params, fresh_kv(cfg, jnp.float32), ModelKernels())
    scales = tuple(jnp.max(jnp.abs(p), axis=(1, 3, 4)) / 240.0 for p in (kv32.k, kv32.v))
    monkeypatch.setattr(
        kernels.registry,
        "get_prefill",
        lambda name: functools.partial(prefill_triton.paged_prefill_attention, interpret=True),
    )
    knobs = dict(interpret=True, pages_per_block=4, num_warps=4, num_stages=1, k_splits=2)
    mk = model_kernels(
        kernel_config(decode_attention="triton", prefill_attention="triton"), decode_knobs=knobs
    )
    with jax.default_matmul_precision("highest"):
        h_ref, kv_ref = run_steps(cfg, params, fresh_kv(cfg, FP8, scales), ModelKernels())
        h, kv = run_steps(cfg, params, fresh_kv(cfg, FP8, scales), mk)
    assert kv.k.dtype == kv.v.dtype == FP8 and kv.k_scale is not None
    np.testing.assert_allclose(np.asarray(h), np.asarray(h_ref), rtol=1e-4, atol=1e-4)
    for got, want in ((kv.k, kv_ref.k), (kv.v, kv_ref.v)):
        assert np.mean(np.asarray(got) == np.asarray(want)) > 0.999
    rel = float(jnp.linalg.norm(h_ref - h32) / jnp.linalg.norm(h32))
    assert 1e-4 < rel < 1e-1, rel


def test_smoothing_means_cancel(model):
    """K/V smoothing (SageAttention, arXiv 2410.02367): fp8 pages holding ``x - m`` for arbitrary
    means m f32[L, K, H] up to the largest |x| give the float32-KV run within the 10% of fp8
    rounding (the K mean cancels in the softmax, the V mean is added to the output: without it,
    off by about the output itself); float32 pools ignore the means."""
    cfg, params = model
    h32, kv32 = run_steps(cfg, params, fresh_kv(cfg, jnp.float32), ModelKernels())
    rng = np.random.default_rng(7)
    shape = (cfg.num_layers, cfg.num_kv_heads, cfg.head_dim)
    km, vm = (
        jnp.asarray(rng.uniform(-1, 1, shape), jnp.float32) * jnp.max(jnp.abs(p))
        for p in (kv32.k, kv32.v)
    )
    scales = tuple(
        jnp.max(jnp.abs(p - m[:, None, :, None]), axis=(1, 3, 4)) / 240.0
        for p, m in ((kv32.k, km), (kv32.v, vm))
    )
    kv = fresh_kv(cfg, FP8, scales, (km, vm)).replace(k_mean=km)
    rel = [
        float(jnp.linalg.norm(h - h32) / jnp.linalg.norm(h32))
        for h, _ in (
            run_steps(cfg, params, kv.replace(v_mean=vm), ModelKernels()),
            run_steps(cfg, params, kv, ModelKernels()),
        )
    ]  # pages hold v - vm
    assert 1e-4 < rel[0] < 1e-1 and rel[1] > 0.5, rel
    f32 = fresh_kv(cfg, jnp.float32).replace(k_mean=km, v_mean=vm)
    np.testing.assert_array_equal(
        np.asarray(run_steps(cfg, params, f32, ModelKernels())[0]), np.asarray(h32)
    )


def test_engine_generates_with_fp8_kv(tiny_cfg, tiny_params):
    cfg, params = tiny_cfg, tiny_params
    kw = dict(max_model_len=64, max_num_seqs=4, num_pages=24)
    greedy = SamplingParams(temperature=0.0, max_tokens=8)
    prompts = [[1, 2, 3, 4, 5], [7, 8, 9] * 7, [200]]
    fp8 = LLM.from_params(cfg, params, kv_cache_dtype="fp8", **kw)
    kv = fp8.engine.runner.kv
    assert kv.k.dtype == stored_dtype(FP8, jax.default_backend()) and page_dtype(kv.k.dtype) == FP8
    assert kv.k.nbytes == 24 * 2 * 2 * 16 * 16 * 1
    np.testing.assert_array_equal(np.asarray(kv.k_scale), np.ones((2, 2), np.float32))
    auto = LLM.from_params(cfg, params, **kw)
    want = [o.token_ids for o in auto.generate(prompts, greedy)]
    got = [o.token_ids for o in fp8.generate(prompts, greedy)]
    assert all(len(g) == 8 for g in got)
    # greedy on random weights: fp8 rounding may flip a near tie late, never from the start
    assert all(g[:4] == w[:4] for g, w in zip(got, want)), (got, want)
    assert sum(a == b for g, w in zip(got, want) for a, b in zip(g, w)) >= 20


def test_pool_holds_twice_the_tokens_of_bf16():
    """The same free memory: fp8 pages take half the bytes of bfloat16 ones (GPU memory stats),
    a quarter of float32 ones (the CPU budget, capped at CPU_KV_BUDGET_BYTES)."""
    cfg = ModelConfig("qwen3", 1024, 512, 1024, 4, 8, 4, 64)
    stats = {"bytes_limit": 10 * GIB, "bytes_in_use": 1 * GIB}
    pages = {
        kv: engine_pool_pages(resolve(cfg, EngineConfig(kv_cache_dtype=kv), "gpu"), stats)
        for kv in ("auto", "fp8")
    }
    page_bytes = 16 * 2 * 4 * 4 * 64 * 2  # bf16
    assert pages["auto"] == int((0.9 * 10 - 1) * GIB) // page_bytes
    assert pages["fp8"] == int((0.9 * 10 - 1) * GIB) // (page_bytes // 2)
    assert pages["fp8"] in (2 * pages["auto"], 2 * pages["auto"] + 1)
    big = dict(max_num_seqs=1024, max_model_len=4096)  # more than the CPU budget holds
    cpu = {
        kv: engine_pool_pages(resolve(cfg, EngineConfig(kv_cache_dtype=kv, **big), "cpu"), None)
        for kv in ("auto", "fp8")
    }
    assert cpu["fp8"] == 4 * cpu["auto"]
