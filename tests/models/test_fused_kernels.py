"""The model with its optional fused kernels (interpret mode here) against its own jnp path, for
Llama and Qwen3: the attention prologue (q/k norm + RoPE + K/V write in one Pallas launch, decode
steps) and the residual add + RMSNorm (one launch per sub-block boundary, every step)."""

from __future__ import annotations

import dataclasses
import functools
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer import models
from jaxinfer.config import KernelConfig
from jaxinfer.models import layers, llama
from jaxinfer.models.kernels import ModelKernels, PagedAttention, model_kernels
from jaxinfer.models.kv_cache import KVCache
from pallas_kernels.add_rms_norm import triton_pallas as add_norm_kernel
from pallas_kernels.qkv_prologue import triton_pallas

from .test_packed_prefill import _cfg as tiny_cfg

PAGE = 4
PROLOGUE = functools.partial(triton_pallas.qkv_prologue, interpret=True)


def kernel_config(**kw):
    """A resolved `KernelConfig` for the CPU (its values checked there), or, with a value it
    rejects, a plain namespace with its fields (to reach `model_kernels`' own checks)."""
    base = {**dict(decode_attention="reference", prefill_attention="reference",
                   qkv_prologue="xla", add_rms_norm="xla"), **kw}
    try:
        return KernelConfig(**base)
    except ValueError:
        return types.SimpleNamespace(**base)


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
    params = models.init_params(cfg, jax.random.key(3), jnp.float32)
    if arch == "qwen3":  # norm weights away from 1, so a skipped or swapped weight shows
        for lp in params["layers"].values():
            lp["q_norm"] = lp["q_norm"] * 1.5
            lp["k_norm"] = lp["k_norm"] * 0.5
    rng = np.random.default_rng(0)
    pages, kv, pos, slot, tok = decode_batch(cfg, rng, PAGE, lens=[5, 9, 0],
                                             slot_pages=[(0, 1), (1, 2)])
    plain, fused = ModelKernels(), ModelKernels(qkv_prologue=PROLOGUE)
    run = lambda mk: models.forward(params, cfg, tok, jnp.asarray(pos), jnp.asarray(slot),  # noqa: E731
                                    kv, kernels=mk)
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
    params = models.init_params(cfg, jax.random.key(5), jnp.float32)
    params = jax.tree_util.tree_map(lambda p: p * 5.0 if p.ndim == 2 else p, params)
    rng = np.random.default_rng(1)
    _, kv, pos, slot, tok = decode_batch(cfg, rng, page, lens=[6, 17, 0],
                                         slot_pages=[(0, 0), (1, 2)])
    built = model_kernels(kernel_config(decode_attention="mosaic", qkv_prologue="triton"),
                          decode_knobs={"interpret": True})
    assert built.q_group_multiple == 8
    assert built.attention == PagedAttention("mosaic", "reference", (("interpret", True),))
    fused = ModelKernels(built.attention, qkv_prologue=PROLOGUE, q_group_multiple=8)
    # one jitted computation each, waited for: GPU interpret mode runs JAX inside host callbacks,
    # and eager dispatches while they run can deadlock XLA:CPU
    run = lambda mk: jax.block_until_ready(jax.jit(  # noqa: E731
        lambda p, c: models.forward(p, cfg, tok, jnp.asarray(pos), jnp.asarray(slot), c,
                                    kernels=mk))(params, kv))
    (h0, kv0), (h1, kv1) = run(ModelKernels()), run(fused)
    assert float(jnp.std(h0[:2])) > 0.1
    np.testing.assert_allclose(np.asarray(h1[:2]), np.asarray(h0[:2]), rtol=1e-4, atol=1e-4)
    for a, b in ((kv1.k, kv0.k), (kv1.v, kv0.v)):
        np.testing.assert_allclose(np.asarray(a)[:, 1:], np.asarray(b)[:, 1:], rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("field", ["qkv_prologue", "add_rms_norm"])
def test_fused_kernel_names(field):
    """"xla" is the model's jnp path (None), "triton" the Pallas kernel; others are rejected.
    (A GPU kernel on a non-GPU platform is rejected by `jaxinfer.config.resolve`.)"""
    from pallas_kernels.add_rms_norm import triton_pallas as add_norm_triton
    assert getattr(model_kernels(kernel_config(**{field: "xla"})), field) is None
    want = {"qkv_prologue": triton_pallas.qkv_prologue,
            "add_rms_norm": add_norm_triton.add_rms_norm}[field]
    assert getattr(model_kernels(kernel_config(**{field: "triton"})), field) is want
    with pytest.raises(ValueError, match=f"{field}='cuda' is not one of"):
        model_kernels(kernel_config(**{field: "cuda"}))


def test_model_kernels_attention():
    """The reference pair is the reference function itself; other variants a value-equal
    (so jit-cache-sharing) dispatch; the prologue groups q only for mosaic; knobs need a
    decode kernel; unknown variants are rejected with the registered names."""
    from pallas_kernels.paged_attention import reference
    assert model_kernels(kernel_config()) == ModelKernels(reference.paged_attention)
    a = model_kernels(kernel_config(prefill_attention="triton", qkv_prologue="triton"))
    assert a.attention == PagedAttention("reference", "triton") and a.q_group_multiple is None
    assert hash(a) == hash(model_kernels(kernel_config(prefill_attention="triton",
                                                       qkv_prologue="triton")))
    assert model_kernels(kernel_config(decode_attention="mosaic")).q_group_multiple is None
    with pytest.raises(ValueError, match="decode_knobs"):
        model_kernels(kernel_config(), decode_knobs={"num_splits": 3})
    with pytest.raises(ValueError, match="registered"):
        model_kernels(kernel_config(decode_attention="auto"))


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("T", [1, 3])
def test_fused_add_rms_norm_matches_jnp_path(arch, T):
    cfg = _cfg(arch)
    params = models.init_params(cfg, jax.random.key(4), jnp.float32)
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
    fused = ModelKernels(add_rms_norm=kernel)
    both = ModelKernels(add_rms_norm=kernel, qkv_prologue=PROLOGUE)
    run = lambda mk: models.forward(params, cfg, tok, jnp.asarray(pos),  # noqa: E731
                                    jnp.asarray(slot.astype(np.int32)), kv, kernels=mk)
    h0, kv0 = run(ModelKernels())
    for mk in (fused, both):
        h1, kv1 = run(mk)
        np.testing.assert_allclose(np.asarray(h1), np.asarray(h0), rtol=2e-5, atol=2e-5)
        np.testing.assert_allclose(np.asarray(kv1.k), np.asarray(kv0.k), rtol=2e-5, atol=2e-5)
    # the hidden states are not trivially equal: a zero pending MLP output would change them
    assert float(jnp.abs(h0).max()) > 0.1


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_decode_down_projection_as_partial_sums_matches_jnp_path(arch, monkeypatch):
    """With the add + RMSNorm kernel, large decode batches pass the MLP output on as float32
    partial sums over halves of F (cheaper GEMMs on the GPU); the next add + norm sums them. Here
    the row threshold is lowered to this 3-row batch, and the result is the jnp path's."""
    cfg = _cfg(arch)
    params = models.init_params(cfg, jax.random.key(6), jnp.float32)
    params = jax.tree_util.tree_map(lambda p: p * 3.0 if p.ndim == 2 else p, params)
    rng = np.random.default_rng(2)
    _, kv, pos, slot, tok = decode_batch(cfg, rng, PAGE, lens=[5, 9, 0],
                                         slot_pages=[(0, 1), (1, 2)])
    kernel = functools.partial(add_norm_kernel.add_rms_norm, interpret=True)
    seen = []

    def recording_kernel(x, delta, w, eps):
        seen.append(None if delta is None else delta.shape)
        return kernel(x, delta, w, eps=eps)

    run = lambda mk: models.forward(params, cfg, tok, jnp.asarray(pos), jnp.asarray(slot),  # noqa: E731
                                    kv, kernels=mk)
    h0, _ = run(ModelKernels())
    monkeypatch.setattr(llama, "DOWN_PARTIALS_MIN_ROWS", 3)
    h1, _ = run(ModelKernels(add_rms_norm=recording_kernel))
    D = cfg.hidden_size
    # layer 0's attn norm has no delta; every later norm after an MLP gets 2 partial sums
    assert seen[0] is None and (llama.DOWN_PARTIALS, 3, D) in seen
    assert seen.count((llama.DOWN_PARTIALS, 3, D)) == cfg.num_layers
    np.testing.assert_allclose(np.asarray(h1[:2]), np.asarray(h0[:2]), rtol=2e-5, atol=2e-5)
    assert float(jnp.std(h0[:2])) > 0.1
    # the XLA path sums partial sums too (add_rms_norm without a kernel)
    x = jnp.asarray(rng.standard_normal((2, 1, D)), jnp.float32)
    parts = jnp.asarray(rng.standard_normal((2, 2, 1, D)), jnp.float32)
    got = layers.add_rms_norm(x, parts, jnp.ones((D,)), eps=1e-6)
    want = layers.add_rms_norm(x, parts[0] + parts[1], jnp.ones((D,)), eps=1e-6)
    for g, r in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("T", [1, 3])
def test_unrolled_layers_share_one_kernel_lowering(T, monkeypatch):
    """The model calls attention once per layer with a Python-int layer; `PagedAttention` runs
    the kernel (decode for T == 1, prefill for T > 1) behind one inner jit with a traced layer,
    so an L-layer step traces and lowers it once."""
    import re

    from jaxinfer.models import kernels
    from pallas_kernels.paged_attention import prefill_triton
    prefill = functools.partial(prefill_triton.paged_prefill_attention, interpret=True)
    monkeypatch.setattr(kernels.registry, "get_prefill", lambda name: prefill)  # no prefill knobs
    knobs = dict(interpret=True, pages_per_block=4, num_warps=4, num_stages=1, k_splits=1)
    mk = model_kernels(kernel_config(decode_attention="triton", prefill_attention="triton"),
                       decode_knobs=knobs)
    assert mk.attention.decode_knobs == tuple(sorted(knobs.items()))
    cfg = dataclasses.replace(_cfg("qwen3"), num_layers=4)
    params = models.init_params(cfg, jax.random.key(0), jnp.float32)
    pool = (cfg.num_layers, 8, cfg.num_kv_heads, PAGE, cfg.head_dim)
    kv = KVCache(jnp.zeros(pool), jnp.zeros(pool), jnp.asarray([[3, 5], [2, 7]], jnp.int32),
                 jnp.asarray([6, 3 + T], jnp.int32))
    tok = jnp.ones((2, T), jnp.int32)
    pos = jnp.asarray([[5], [2]], jnp.int32) + jnp.arange(T)

    def step(p, c):
        return models.forward(p, cfg, tok, pos, pos + 8, c, kernels=mk)[0]

    name = "decode_step" if T == 1 else "prefill_step"
    calls = [e for e in jax.make_jaxpr(step)(params, kv).jaxpr.eqns
             if e.params.get("name") == name]
    assert len(calls) == cfg.num_layers
    assert len({id(e.params["jaxpr"]) for e in calls}) == 1
    text = jax.jit(step).lower(params, kv).as_text()
    assert len(re.findall(rf"func\.func private @{name}\b", text)) == 1
