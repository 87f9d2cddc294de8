"""The model with its optional fused kernels (interpret mode here) against its own jnp path, for
Llama and Qwen3: the attention prologue (q/k norm + RoPE + K/V write in one Pallas launch, decode
steps) and the residual add + RMSNorm (one launch per sub-block boundary, every step)."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.attention import add_rms_norm_fn, make_attention_fn, qkv_prologue_fn
from jaxinfer.kv_cache import KVCache
from jaxinfer.models import registry
from pallas_kernels.add_rms_norm import triton_pallas as add_norm_kernel
from pallas_kernels.qkv_prologue import triton_pallas

from .test_packed_prefill import _cfg as tiny_cfg

PAGE = 4


def _cfg(arch):
    # the packed-prefill tests' tiny model, with H/2 a power of 2 as the Triton kernel needs
    return dataclasses.replace(tiny_cfg(arch), head_dim=16)


def decode_batch(cfg, rng, page, *, lens, slot_pages):
    """A decode step of 3 rows over random pools [L, 1 + 9, K, page, H] (3 pages per row, pages
    a random permutation of 1..9): row b's new token at position lens[b] - 1, written into its
    logical page slot_pages[b][1] (which must hold that position); the last row is padding
    (length 0, null page). Returns (pages i32[3, 3], kv, positions, slots, tokens)."""
    B, M = 3, 3
    pages = rng.permutation(np.arange(1, 1 + B * M)).reshape(B, M).astype(np.int32)
    shape = (cfg.num_layers, 1 + B * M, cfg.num_kv_heads, page, cfg.head_dim)
    kv = KVCache(k=jnp.asarray(rng.standard_normal(shape), jnp.float32),
                 v=jnp.asarray(rng.standard_normal(shape), jnp.float32),
                 block_tables=jnp.asarray(pages), seq_lens=jnp.asarray(lens, jnp.int32))
    pos = np.array([[max(n - 1, 0)] for n in lens], np.int32)
    slot = np.zeros((B, 1), np.int32)
    for b, lp in slot_pages:
        assert lp == (lens[b] - 1) // page
        slot[b, 0] = pages[b, lp] * page + (lens[b] - 1) % page
    tok = jnp.asarray(rng.integers(0, cfg.vocab_size, (B, 1)).astype(np.int32))
    return pages, kv, pos, slot, tok


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_decode_step_with_fused_prologue_matches_jnp_path(arch):
    cfg = _cfg(arch)
    params = registry.init_params(cfg, jax.random.key(3), jnp.float32)
    if arch == "qwen3":  # norm weights away from 1, so a skipped or swapped weight shows
        for lp in params["layers"].values():
            lp["q_norm"] = lp["q_norm"] * 1.5
            lp["k_norm"] = lp["k_norm"] * 0.5
    rng = np.random.default_rng(0)
    pages, kv, pos, slot, tok = decode_batch(cfg, rng, PAGE, lens=[5, 9, 0],
                                             slot_pages=[(0, 1), (1, 2)])
    plain = make_attention_fn("reference", "reference")
    fused = make_attention_fn("reference", "reference", qkv_prologue=functools.partial(
        triton_pallas.qkv_prologue, interpret=True))
    assert fused.qkv_prologue is not None and not hasattr(plain, "qkv_prologue")
    run = lambda attn: registry.forward(params, cfg, tok, jnp.asarray(pos), jnp.asarray(slot),  # noqa: E731
                                        kv, attn_fn=attn)
    (h0, kv0), (h1, kv1) = run(plain), run(fused)
    np.testing.assert_allclose(np.asarray(h1[:2]), np.asarray(h0[:2]), rtol=2e-5, atol=2e-5)
    for a, b in ((kv1.k, kv0.k), (kv1.v, kv0.v)):
        np.testing.assert_allclose(np.asarray(a)[:, 1:], np.asarray(b)[:, 1:], rtol=2e-5, atol=2e-5)
    # the written slots really changed (the comparison above is not between two untouched pools)
    assert not np.allclose(np.asarray(kv0.k)[:, pages[0, 1], :, 0], np.asarray(kv.k)[:, pages[0, 1], :, 0])


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_decode_step_grouped_q_into_mosaic_matches_jnp_path(arch):
    """With the mosaic decode kernel the prologue writes q grouped by KV head and zero-padded
    ([B, 1, K, 8, H]), which the kernel reads without a pad of its own; both in interpret mode,
    against the jnp path with the reference attention."""
    pytest.importorskip("jax._src.pallas.mosaic_gpu.interpret.params")
    cfg = dataclasses.replace(tiny_cfg(arch), head_dim=64)   # mosaic: H a multiple of 64
    page = 8                                                 # and pages a multiple of 8
    params = registry.init_params(cfg, jax.random.key(5), jnp.float32)
    params = jax.tree_util.tree_map(lambda p: p * 5.0 if p.ndim == 2 else p, params)
    rng = np.random.default_rng(1)
    _, kv, pos, slot, tok = decode_batch(cfg, rng, page, lens=[6, 17, 0],
                                         slot_pages=[(0, 0), (1, 2)])
    plain = make_attention_fn("reference", "reference")
    fused = make_attention_fn("mosaic", "reference", decode_knobs={"interpret": True},
                              qkv_prologue=functools.partial(triton_pallas.qkv_prologue,
                                                             interpret=True))
    assert fused.q_group_multiple == 8
    run = lambda attn: registry.forward(params, cfg, tok, jnp.asarray(pos), jnp.asarray(slot),  # noqa: E731
                                        kv, attn_fn=attn)
    (h0, kv0), (h1, kv1) = run(plain), run(fused)
    assert float(jnp.std(h0[:2])) > 0.1
    np.testing.assert_allclose(np.asarray(h1[:2]), np.asarray(h0[:2]), rtol=1e-4, atol=1e-4)
    for a, b in ((kv1.k, kv0.k), (kv1.v, kv0.v)):
        np.testing.assert_allclose(np.asarray(a)[:, 1:], np.asarray(b)[:, 1:], rtol=2e-5, atol=2e-5)


def test_qkv_prologue_names():
    assert qkv_prologue_fn("xla") is None
    with pytest.raises(ValueError, match="not one of"):
        qkv_prologue_fn("cuda")
    if jax.default_backend() != "gpu":
        with pytest.raises(ValueError, match="GPU kernel"):
            qkv_prologue_fn("triton")


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("T", [1, 3])
def test_fused_add_rms_norm_matches_jnp_path(arch, T):
    cfg = _cfg(arch)
    params = registry.init_params(cfg, jax.random.key(4), jnp.float32)
    for lp in params["layers"].values():  # norm weights away from 1, so a swapped one shows
        lp["attn_norm"] = lp["attn_norm"] * 1.5
        lp["mlp_norm"] = lp["mlp_norm"] * 0.75
    params["final_norm"] = params["final_norm"] * 2.0
    rng = np.random.default_rng(1)
    B, M = 2, 3
    pages = rng.permutation(np.arange(1, 1 + B * M)).reshape(B, M).astype(np.int32)
    shape = (cfg.num_layers, 1 + B * M, cfg.num_kv_heads, PAGE, cfg.head_dim)
    kv = KVCache(k=jnp.asarray(rng.standard_normal(shape), jnp.float32),
                 v=jnp.asarray(rng.standard_normal(shape), jnp.float32),
                 block_tables=jnp.asarray(pages), seq_lens=jnp.asarray([4 + T, 2 + T], jnp.int32))
    pos = np.stack([np.arange(4, 4 + T), np.arange(2, 2 + T)]).astype(np.int32)
    slot = np.take_along_axis(pages, pos // PAGE, 1) * PAGE + pos % PAGE
    tok = jnp.asarray(rng.integers(0, cfg.vocab_size, (B, T)).astype(np.int32))
    kernel = functools.partial(add_norm_kernel.add_rms_norm, interpret=True)
    plain = make_attention_fn("reference", "reference")
    fused = make_attention_fn("reference", "reference", add_rms_norm=kernel)
    both = make_attention_fn("reference", "reference", add_rms_norm=kernel,
                             qkv_prologue=functools.partial(triton_pallas.qkv_prologue,
                                                            interpret=True))
    assert fused.add_rms_norm is kernel and not hasattr(fused, "qkv_prologue")
    run = lambda attn: registry.forward(params, cfg, tok, jnp.asarray(pos),  # noqa: E731
                                        jnp.asarray(slot.astype(np.int32)), kv, attn_fn=attn)
    h0, kv0 = run(plain)
    for attn in (fused, both):
        h1, kv1 = run(attn)
        np.testing.assert_allclose(np.asarray(h1), np.asarray(h0), rtol=2e-5, atol=2e-5)
        np.testing.assert_allclose(np.asarray(kv1.k), np.asarray(kv0.k), rtol=2e-5, atol=2e-5)
    # the hidden states are not trivially equal: a zero pending MLP output would change them
    assert float(jnp.abs(h0).max()) > 0.1


def test_add_rms_norm_names():
    assert add_rms_norm_fn("xla") is None
    with pytest.raises(ValueError, match="not one of"):
        add_rms_norm_fn("cuda")
    if jax.default_backend() != "gpu":
        with pytest.raises(ValueError, match="GPU kernel"):
            add_rms_norm_fn("triton")


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_decode_down_projection_as_partial_sums_matches_jnp_path(arch, monkeypatch):
    """With the add + RMSNorm kernel, large decode batches pass the MLP output on as float32
    partial sums over halves of F (cheaper GEMMs on the GPU); the next add + norm sums them. Here
    the row threshold is lowered to this 3-row batch, and the result is the jnp path's."""
    from jaxinfer.models import common
    cfg = _cfg(arch)
    params = registry.init_params(cfg, jax.random.key(6), jnp.float32)
    params = jax.tree_util.tree_map(lambda p: p * 3.0 if p.ndim == 2 else p, params)
    rng = np.random.default_rng(2)
    _, kv, pos, slot, tok = decode_batch(cfg, rng, PAGE, lens=[5, 9, 0],
                                         slot_pages=[(0, 1), (1, 2)])
    kernel = functools.partial(add_norm_kernel.add_rms_norm, interpret=True)
    seen = []

    def recording_kernel(x, delta, w, eps):
        seen.append(None if delta is None else delta.shape)
        return kernel(x, delta, w, eps=eps)

    run = lambda attn: registry.forward(params, cfg, tok, jnp.asarray(pos), jnp.asarray(slot),  # noqa: E731
                                        kv, attn_fn=attn)
    h0, _ = run(make_attention_fn("reference", "reference"))
    monkeypatch.setattr(common, "DOWN_PARTIALS_MIN_ROWS", 3)
    h1, _ = run(make_attention_fn("reference", "reference", add_rms_norm=recording_kernel))
    D = cfg.hidden_size
    # layer 0's attn norm has no delta; every later norm after an MLP gets 2 partial sums
    assert seen[0] is None and (common.DOWN_PARTIALS, 3, D) in seen
    assert seen.count((common.DOWN_PARTIALS, 3, D)) == cfg.num_layers
    np.testing.assert_allclose(np.asarray(h1[:2]), np.asarray(h0[:2]), rtol=2e-5, atol=2e-5)
    assert float(jnp.std(h0[:2])) > 0.1
    # the XLA path sums partial sums too (AddRMSNorm without a kernel)
    blk = common.AddRMSNorm("n", 1e-6)
    x = jnp.asarray(rng.standard_normal((2, 1, D)), jnp.float32)
    parts = jnp.asarray(rng.standard_normal((2, 2, 1, D)), jnp.float32)
    w = {"n": jnp.ones((D,))}
    got = blk.apply({"params": w}, x, parts)
    want = blk.apply({"params": w}, x, parts[0] + parts[1])
    for g, r in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-6, atol=1e-6)
