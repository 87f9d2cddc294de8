"""Paged decode attention: the Triton-lowered variant vs the float32 reference, one suite run in
two modes (`modes.py`): Pallas interpret mode on the CPU and compiled on a CUDA GPU (``-m gpu``).

Interpret mode starts every output buffer as NaN (Pallas' uninitialised value), so
an output row or a flash-decoding partial that the kernel forgets to write shows up as NaN; compiled
outputs cannot be pre-filled, so every element is checked finite and matched against the reference.
Each case draws fresh random data (never zeros) over the whole pool, page 0 included, with a
permuted block table and ragged lengths. The tuned-knob table and the split count:
test_paged_decode_tuning.py.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.paged_attention import reference, triton_pallas

from .modes import GPU

# name: (page_size, H, N, K, M, lens, dtype, L, layer, k_splits, pages_per_block, extra kwargs)
# lens use ps = page_size and mx = M * page_size; 0 is a padded row.
CASES = {
    "p16_h64_g1_f32_edges": (
        16,
        64,
        2,
        2,
        4,
        ["1", "ps-1", "ps", "ps+1", "mx", "0", "37"],
        "float32",
        2,
        1,
        1,
        2,
        {},
    ),
    "p16_h128_g4_f32_split3": (
        16,
        128,
        8,
        2,
        5,
        ["mx", "1", "0", "33", "ps+1"],
        "float32",
        2,
        0,
        3,
        1,
        {},
    ),
    "p64_h64_g2_bf16_split2": (
        64,
        64,
        4,
        2,
        2,
        ["1", "ps-1", "ps", "ps+1", "mx", "101"],
        "bfloat16",
        2,
        1,
        2,
        1,
        {},
    ),
    "p32_h128_g8_bf16": (
        32,
        128,
        16,
        2,
        3,
        ["mx", "ps+1", "0", "45", "ps-1"],
        "bfloat16",
        1,
        0,
        1,
        2,
        {},
    ),
    "p16_h64_g2_f32_softcap_window": (
        16,
        64,
        4,
        2,
        4,
        ["mx", "ps+1", "1", "50"],
        "float32",
        2,
        1,
        2,
        1,
        {"soft_cap": 5.0, "sliding_window": 21},
    ),
    "p16_h64_g4_f32_many_splits": (
        16,
        64,
        4,
        1,
        4,
        ["mx", "3", "0", "ps+1"],
        "float32",
        1,
        0,
        8,
        1,
        {},
    ),
}

TOL = {"float32": 1e-5, "bfloat16": 1e-2}


def _len(expr: str, page_size: int, M: int) -> int:
    return int(eval(expr, {}, {"ps": page_size, "mx": M * page_size}))  # noqa: S307 (table above)


def make_case(name: str, seed: int = 0):
    """Random inputs of one `CASES` entry: (args, kwargs, knobs, dtype name)."""
    page_size, H, N, K, M, lens, dtype, L, layer, k_splits, ppb, extra = CASES[name]
    rng = np.random.default_rng(seed)
    B = len(lens)
    P = B * M + 3  # spare pages; page 0 is the null page
    seq_lens = np.array([_len(e, page_size, M) for e in lens], np.int32)
    pages = rng.permutation(np.arange(1, P))[: B * M].reshape(B, M).astype(np.int32)
    n_used = -(-seq_lens // page_size)
    block_tables = np.where(np.arange(M)[None, :] < n_used[:, None], pages, 0).astype(np.int32)
    dt = jnp.dtype(dtype)
    q = jnp.asarray(rng.standard_normal((B, N, H)), dt)
    k_pool = jnp.asarray(rng.standard_normal((L, P, K, page_size, H)), dt)
    v_pool = jnp.asarray(rng.standard_normal((L, P, K, page_size, H)), dt)
    args = (q, k_pool, v_pool, jnp.asarray(block_tables), jnp.asarray(seq_lens))
    kwargs = dict(layer=layer, scale=H**-0.5, **extra)
    return args, kwargs, dict(k_splits=k_splits, pages_per_block=ppb), dtype


def check_against_reference(out, args, kwargs, dtype):
    """Finite everywhere, zeros for padded rows, and within the dtype's tolerance of the reference
    (float32 reference on the same, possibly bf16-rounded, inputs)."""
    q, k_pool, v_pool, bt, seq_lens = args
    # "highest": on a GPU, XLA's default float32 matmul is tf32 (~3e-4 error), not a reference.
    with jax.default_matmul_precision("highest"):
        ref = reference.paged_decode_attention(
            q.astype(jnp.float32),
            k_pool.astype(jnp.float32),
            v_pool.astype(jnp.float32),
            bt,
            seq_lens,
            **kwargs,
        )
    out = np.asarray(out.astype(jnp.float32))
    ref = np.asarray(ref)
    assert out.shape == ref.shape
    assert np.all(np.isfinite(out)), "non-finite output (unwritten row or partial?)"
    assert np.all(out[np.asarray(seq_lens) == 0] == 0), "padded rows must be zeros"
    tol = TOL[dtype]
    rel = np.linalg.norm(out - ref) / np.linalg.norm(ref)
    assert rel < tol, f"relative error {rel:.2e} >= {tol}"
    np.testing.assert_allclose(out, ref, rtol=tol, atol=tol * 4)


VARIANTS = {"triton": triton_pallas.paged_decode_attention}
RUNS = [
    pytest.param("triton", "interpret", id="triton-interpret"),
    pytest.param("triton", "compiled", marks=GPU, id="triton-compiled"),
]


def run(variant, mode, *args, **kwargs):
    if mode == "interpret":
        kwargs["interpret"] = True
    return VARIANTS[variant](*args, **kwargs)


@pytest.mark.parametrize("variant, mode", RUNS)
@pytest.mark.parametrize("name", sorted(CASES))
def test_matches_reference(variant, mode, name):
    args, kwargs, knobs, dtype = make_case(name)
    out = run(variant, mode, *args, **kwargs, **knobs)
    assert out.dtype == args[0].dtype
    check_against_reference(out, args, kwargs, dtype)


@pytest.mark.parametrize("variant, mode", RUNS)
def test_traced_layer_in_scan(variant, mode):
    """The engine passes the layer index traced (`jaxinfer.models.kernels`' inner jit): one kernel
    lowering serves every layer, so a traced layer must select the right pool slice."""
    args, kwargs, knobs, dtype = make_case("p16_h64_g1_f32_edges", seed=1)
    q, k_pool, v_pool, bt, seq_lens = args
    kwargs = {k: v for k, v in kwargs.items() if k != "layer"}

    def step(carry, layer):
        return carry, run(
            variant, mode, q, k_pool, v_pool, bt, seq_lens, layer=layer, **kwargs, **knobs
        )

    _, outs = jax.jit(lambda: jax.lax.scan(step, 0, jnp.arange(k_pool.shape[0])))()
    for layer in range(k_pool.shape[0]):
        check_against_reference(outs[layer], args, dict(kwargs, layer=layer), dtype)


def qwen3_case():
    """32/8 heads, H=128, page 16, bf16, a ragged long batch; layer 1 passed traced."""
    rng = np.random.default_rng(11)
    B, N, K, H, ps, M, L = 6, 32, 8, 128, 16, 40, 2
    P = B * M + 1
    seq_lens = np.array([640, 1, 0, 17, 333, 600], np.int32)
    pages = rng.permutation(np.arange(1, P))[: B * M].reshape(B, M).astype(np.int32)
    q = jnp.asarray(rng.standard_normal((B, N, H)), jnp.bfloat16)
    k_pool = jnp.asarray(rng.standard_normal((L, P, K, ps, H)), jnp.bfloat16)
    v_pool = jnp.asarray(rng.standard_normal((L, P, K, ps, H)), jnp.bfloat16)
    args = (q, k_pool, v_pool, jnp.asarray(pages), jnp.asarray(seq_lens))
    return args, dict(layer=1, scale=H**-0.5), "bfloat16"


@pytest.mark.parametrize("variant, mode", RUNS)
def test_default_knobs(variant, mode):
    """Knobs left as None come from the tuning table (the interpret entry on the CPU; the tuned
    defaults with automatic k_splits at a Qwen3-8B-like shape on the GPU) and stay correct."""
    if mode == "interpret":
        args, kwargs, _, dtype = make_case("p64_h64_g2_bf16_split2", seed=2)
        out = run(variant, mode, *args, **kwargs)
    else:
        args, kwargs, dtype = qwen3_case()
        fn = VARIANTS[variant]
        out = jax.jit(lambda *a: fn(*a[:5], layer=a[5], scale=kwargs["scale"]))(
            *args, jnp.int32(kwargs["layer"])
        )
    check_against_reference(out, args, kwargs, dtype)


def test_combine_splits_matches_full_softmax():
    """`combine_splits` on partials cut at random points equals the one-pass softmax (numpy)."""
    rng = np.random.default_rng(3)
    S, R, H, T = 4, 5, 8, 23
    x = rng.standard_normal((R, T)) * 3  # logits in log2 units
    v = rng.standard_normal((T, H))
    cuts = np.sort(rng.choice(np.arange(1, T), S - 2, replace=False))
    bounds = [0, *cuts, T, T]  # the last split is empty
    acc, m, l = [], [], []
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        if hi == lo:
            m.append(np.full(R, triton_pallas.NEG_INIT))
            l.append(np.zeros(R))
            acc.append(np.zeros((R, H)))
            continue
        ms = x[:, lo:hi].max(1)
        p = np.exp2(x[:, lo:hi] - ms[:, None])
        m.append(ms)
        l.append(p.sum(1))
        acc.append(p @ v[lo:hi])
    out = triton_pallas.combine_splits(
        *(jnp.asarray(np.stack(a), jnp.float32) for a in (acc, m, l))
    )
    w = np.exp2(x - x.max(1, keepdims=True))
    expect = (w / w.sum(1, keepdims=True)) @ v
    np.testing.assert_allclose(np.asarray(out), expect, rtol=1e-5, atol=1e-6)
    # all splits empty (seq_len 0): zeros, not NaN
    empty = triton_pallas.combine_splits(
        jnp.zeros((2, R, H)), jnp.full((2, R), -1e30), jnp.zeros((2, R))
    )
    assert np.all(np.asarray(empty) == 0)


def test_bad_input_raises():
    args, kwargs, knobs, _ = make_case("p16_h64_g1_f32_edges")
    q, k_pool, v_pool, bt, seq_lens = args
    fn = triton_pallas.paged_decode_attention
    with pytest.raises(ValueError, match="block_tables dtype"):
        fn(q, k_pool, v_pool, bt.astype(jnp.float32), seq_lens, **kwargs, interpret=True)
    with pytest.raises(ValueError, match="multiple of KV heads"):
        fn(q[:, :1].repeat(3, axis=1), k_pool, v_pool, bt, seq_lens, **kwargs, interpret=True)
    with pytest.raises(ValueError, match="pages_per_block"):
        fn(*args, **kwargs, interpret=True, pages_per_block=3)
    with pytest.raises(ValueError, match="sliding_window"):
        fn(*args, **dict(kwargs, sliding_window=0), interpret=True)
    with pytest.raises(ValueError, match="page_size=24"):
        fn(
            q,
            k_pool[:, :, :, :12].repeat(2, axis=3),
            v_pool[:, :, :, :12].repeat(2, axis=3),
            bt,
            seq_lens,
            **kwargs,
            interpret=True,
        )


def test_unrolled_layers_share_one_kernel_lowering(monkeypatch):
    """The model calls the attention once per layer (each layer a call of one jitted body);
    `jaxinfer.models.kernels.model_kernels` routes decode through one inner jit with a traced
    layer, so a 4-layer step traces and lowers the kernel once, and its output equals the reference
    model's."""
    import re

    from jaxinfer import models
    from jaxinfer.config import KernelConfig, ModelConfig
    from jaxinfer.models import kernels
    from jaxinfer.models.kv_cache import KVCache

    knobs = dict(interpret=True, pages_per_block=4, num_warps=4, num_stages=1, k_splits=1)
    kernel = functools.partial(triton_pallas.paged_decode_attention, **knobs)
    monkeypatch.setattr(kernels.registry, "get", lambda name: kernel)
    attn = kernels.model_kernels(KernelConfig("triton", "reference"))
    cfg = ModelConfig("qwen3", 256, 64, 96, 4, 4, 2, 16)
    params = models.init_params(cfg, jax.random.key(0), jnp.float32)
    rng = np.random.default_rng(0)
    pool = (cfg.num_layers, 8, cfg.num_kv_heads, 4, cfg.head_dim)
    kv = KVCache(
        jnp.asarray(rng.standard_normal(pool), jnp.float32),
        jnp.asarray(rng.standard_normal(pool), jnp.float32),
        jnp.asarray([[3, 5], [2, 7]], jnp.int32),
        jnp.asarray([6, 3], jnp.int32),
    )
    tok = jnp.asarray([[7], [11]], jnp.int32)
    pos, slots = jnp.asarray([[5], [2]], jnp.int32), jnp.asarray([[21], [10]], jnp.int32)

    def step(params, kv, mk):
        return models.forward(params, cfg, tok, pos, slots, kv, kernels=mk)[0]

    jaxpr = jax.make_jaxpr(lambda p, c: step(p, c, attn))(params, kv).jaxpr
    layers = [e for e in jaxpr.eqns if e.params.get("name") == "decoder_layer"]
    assert len(layers) == cfg.num_layers  # one jitted layer body, the layer index an argument
    calls = [
        e
        for lay in layers
        for e in lay.params["jaxpr"].jaxpr.eqns
        if e.params.get("name") == "decode_step"
    ]
    assert len(calls) == cfg.num_layers
    assert len({id(e.params["jaxpr"]) for e in calls}) == 1
    text = jax.jit(lambda p, c: step(p, c, attn)).lower(params, kv).as_text()
    assert len(re.findall(r"func\.func private @decode_step\b", text)) == 1
    with jax.default_matmul_precision("highest"):
        got = jax.jit(lambda p, c: step(p, c, attn))(params, kv)
        want = jax.jit(lambda p, c: step(p, c, kernels.ModelKernels()))(params, kv)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-4)
