"""The model's kernel choice (`model_kernels`, `ModelKernels`): the mosaic decode kernel inside the
model (interpret mode) against the jnp path, the attention dispatch's identity and checks, and one
kernel lowering shared by the unrolled layers."""

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
from jaxinfer.models.kernels import ModelKernels, PagedAttention, model_kernels
from jaxinfer.models.kv_cache import KVCache

from .test_ragged_forward import _cfg as tiny_cfg

PAGE = 4


def kernel_config(**kw):
    """A resolved `KernelConfig` for the CPU (its values checked there), or, with a value it
    rejects, a plain namespace with its fields (to reach `model_kernels`' own checks)."""
    base = {
        **dict(decode_attention="reference", prefill_attention="reference", moe_gemm="ragged_dot"),
        **kw,
    }
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
    kv = KVCache(
        k=jnp.asarray(rng.standard_normal(shape), jnp.float32),
        v=jnp.asarray(rng.standard_normal(shape), jnp.float32),
        block_tables=jnp.asarray(pages),
        seq_lens=jnp.asarray(lens, jnp.int32),
    )
    pos = np.array([[max(n - 1, 0)] for n in lens], np.int32)
    slot = np.zeros((B, 1), np.int32)
    for b, lp in slot_pages:
        assert lp == (lens[b] - 1) // page
        slot[b, 0] = pages[b, lp] * page + (lens[b] - 1) % page
    tok = jnp.asarray(rng.integers(0, cfg.vocab_size, (B, 1)).astype(np.int32))
    return pages, kv, pos, slot, tok


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_decode_step_with_mosaic_matches_jnp_path(arch):
    """The mosaic decode kernel (interpret mode) inside the model against the jnp path with the
    reference attention."""
    pytest.importorskip("jax._src.pallas.mosaic_gpu.interpret.params")
    cfg = dataclasses.replace(tiny_cfg(arch), head_dim=64)  # mosaic: H a multiple of 64
    page = 8  # and pages a multiple of 8
    params = models.init_params(cfg, jax.random.key(5), jnp.float32)
    params = jax.tree_util.tree_map(lambda p: p * 5.0 if p.ndim == 2 else p, params)
    rng = np.random.default_rng(1)
    _, kv, pos, slot, tok = decode_batch(
        cfg, rng, page, lens=[6, 17, 0], slot_pages=[(0, 0), (1, 2)]
    )
    fused = model_kernels(
        kernel_config(decode_attention="mosaic"), decode_knobs={"interpret": True}
    )
    assert fused.attention == PagedAttention("mosaic", "reference", (("interpret", True),))
    # one jitted computation each, waited for: GPU interpret mode runs JAX inside host callbacks,
    # and eager dispatches while they run can deadlock XLA:CPU
    run = lambda mk: jax.block_until_ready(
        jax.jit(  # noqa: E731
            lambda p, c: models.forward(
                p, cfg, tok, jnp.asarray(pos), jnp.asarray(slot), c, kernels=mk
            )
        )(params, kv)
    )
    (h0, kv0), (h1, kv1) = run(ModelKernels()), run(fused)
    assert float(jnp.std(h0[:2])) > 0.1
    np.testing.assert_allclose(np.asarray(h1[:2]), np.asarray(h0[:2]), rtol=1e-4, atol=1e-4)
    for a, b in ((kv1.k, kv0.k), (kv1.v, kv0.v)):
        np.testing.assert_allclose(np.asarray(a)[:, 1:], np.asarray(b)[:, 1:], rtol=2e-5, atol=2e-5)


def test_model_kernels_attention():
    """The reference pair is the reference function itself; other variants a value-equal
    (so jit-cache-sharing) dispatch; knobs need a decode kernel; unknown variants are rejected
    with the registered names."""
    from pallas_kernels.paged_attention import reference

    assert model_kernels(kernel_config()) == ModelKernels(reference.paged_attention)
    a = model_kernels(kernel_config(prefill_attention="triton"))
    assert a.attention == PagedAttention("reference", "triton")
    assert hash(a) == hash(model_kernels(kernel_config(prefill_attention="triton")))
    with pytest.raises(ValueError, match="decode_knobs"):
        model_kernels(kernel_config(), decode_knobs={"num_splits": 3})
    with pytest.raises(ValueError, match="registered"):
        model_kernels(kernel_config(decode_attention="auto"))


@pytest.mark.parametrize("T", [1, 3])
def test_unrolled_layers_share_one_kernel_lowering(T, monkeypatch):
    """Each of the L layers is a call of one jitted `decoder_layer` with a traced layer index
    (layer 0 traced apart: no pending MLP output yet), and inside it `PagedAttention` runs the
    kernel (decode for T == 1, prefill for T > 1) behind one inner jit, so an L-layer step
    traces the layer body twice and lowers the kernel once."""
    import re

    from jaxinfer.models import kernels
    from pallas_kernels.paged_attention import prefill_triton

    prefill = functools.partial(prefill_triton.paged_prefill_attention, interpret=True)
    monkeypatch.setattr(kernels.registry, "get_prefill", lambda name: prefill)  # no prefill knobs
    knobs = dict(interpret=True, pages_per_block=4, num_warps=4, num_stages=1, k_splits=1)
    mk = model_kernels(
        kernel_config(decode_attention="triton", prefill_attention="triton"), decode_knobs=knobs
    )
    assert mk.attention.decode_knobs == tuple(sorted(knobs.items()))
    cfg = dataclasses.replace(_cfg("qwen3"), num_layers=4)
    params = models.init_params(cfg, jax.random.key(0), jnp.float32)
    pool = (cfg.num_layers, 8, cfg.num_kv_heads, PAGE, cfg.head_dim)
    kv = KVCache(
        jnp.zeros(pool),
        jnp.zeros(pool),
        jnp.asarray([[3, 5], [2, 7]], jnp.int32),
        jnp.asarray([6, 3 + T], jnp.int32),
    )
    tok = jnp.ones((2, T), jnp.int32)
    pos = jnp.asarray([[5], [2]], jnp.int32) + jnp.arange(T)

    def step(p, c):
        return models.forward(p, cfg, tok, pos, pos + 8, c, kernels=mk)[0]

    name = "decode_step" if T == 1 else "prefill_step"
    layers = [
        e
        for e in jax.make_jaxpr(step)(params, kv).jaxpr.eqns
        if e.params.get("name") == "decoder_layer"
    ]
    assert len(layers) == cfg.num_layers
    assert len({id(e.params["jaxpr"]) for e in layers}) == 2  # layer 0, and the others
    calls = [e for e in layers[1].params["jaxpr"].jaxpr.eqns if e.params.get("name") == name]
    assert len(calls) == 1
    text = jax.jit(step).lower(params, kv).as_text()
    assert len(re.findall(rf"func\.func private @{name}\b", text)) == 1
