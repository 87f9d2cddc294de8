"""Paged prefill attention (Pallas, Triton lowering) vs the float32 reference, one suite run in two
modes (`modes.py`): interpret mode on the CPU and compiled on a CUDA GPU (``-m gpu``).

Each row is a prefill chunk: its queries are the last ``n`` positions of a sequence of ``seq_len``
tokens (a whole prompt when n == seq_len, a later chunk otherwise), padded to T with position 0 as
the engine pads them; a row with seq_len 0 is a padded row. Random data everywhere (page 0
included), permuted block tables. Interpret mode starts outputs as NaN, so an unwritten tile shows;
compiled outputs are checked finite element by element.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.paged_attention import prefill_triton, reference

from .modes import GPU, MODES

# name: (page_size, H, N, K, M, rows [(seq_len, n)], dtype, L, layer, knobs, extra kwargs)
CASES = {
    "p16_h64_g1_f32": (
        16,
        64,
        2,
        2,
        4,
        [(37, 37), (64, 10), (0, 0), (17, 1)],
        "float32",
        2,
        1,
        {},
        {},
    ),
    "p8_h32_g4_f32_window_softcap": (
        8,
        32,
        8,
        2,
        6,
        [(48, 48), (20, 5), (9, 9)],
        "float32",
        1,
        0,
        {},
        {"sliding_window": 7, "soft_cap": 5.0},
    ),
    "p32_h64_g2_bf16": (32, 64, 4, 2, 3, [(96, 33), (31, 31), (33, 2)], "bfloat16", 2, 0, {}, {}),
    "p16_h128_g8_f32_small_tiles": (
        16,
        128,
        16,
        2,
        4,
        [(64, 64), (50, 20)],
        "float32",
        1,
        0,
        {"block_q": 2, "pages_per_block": 1},
        {},
    ),
    "p16_h32_g3_f32_odd_group": (
        16,
        32,
        6,
        2,
        3,
        [(40, 40), (7, 7), (33, 17)],
        "float32",
        2,
        1,
        {"block_q": 8, "pages_per_block": 2},
        {},
    ),
}
TOL = {"float32": 1e-5, "bfloat16": 1e-2}


def make_case(name: str, seed: int = 0):
    page_size, H, N, K, M, rows, dtype, L, layer, knobs, extra = CASES[name]
    rng = np.random.default_rng(seed)
    B = len(rows)
    T = max(n for _, n in rows)
    P = B * M + 3
    seq_lens = np.array([s for s, _ in rows], np.int32)
    pages = rng.permutation(np.arange(1, P))[: B * M].reshape(B, M).astype(np.int32)
    n_used = -(-seq_lens // page_size)
    block_tables = np.where(np.arange(M)[None, :] < n_used[:, None], pages, 0).astype(np.int32)
    q_positions = np.zeros((B, T), np.int32)
    for b, (s, n) in enumerate(rows):
        q_positions[b, :n] = np.arange(s - n, s)
    dt = jnp.dtype(dtype)
    q = jnp.asarray(rng.standard_normal((B, T, N, H)), dt)
    k_pool = jnp.asarray(rng.standard_normal((L, P, K, page_size, H)), dt)
    v_pool = jnp.asarray(rng.standard_normal((L, P, K, page_size, H)), dt)
    args = (
        q,
        k_pool,
        v_pool,
        jnp.asarray(block_tables),
        jnp.asarray(seq_lens),
        jnp.asarray(q_positions),
    )
    return args, dict(layer=layer, scale=H**-0.5, **extra), knobs, dtype


def check(out, args, kwargs, dtype):
    q, k_pool, v_pool, bt, seq_lens, q_positions = args
    with jax.default_matmul_precision("highest"):
        ref = reference.paged_attention(
            q.astype(jnp.float32),
            k_pool.astype(jnp.float32),
            v_pool.astype(jnp.float32),
            bt,
            seq_lens,
            q_positions,
            **kwargs,
        )
    assert out.shape == q.shape and out.dtype == q.dtype
    out, ref = np.asarray(out.astype(jnp.float32)), np.asarray(ref)
    assert np.all(np.isfinite(out)), "non-finite output (an unwritten tile?)"
    assert np.all(out[np.asarray(seq_lens) == 0] == 0), "padded rows must be zeros"
    tol = TOL[dtype]
    rel = np.linalg.norm(out - ref) / np.linalg.norm(ref)
    assert rel < tol, f"relative error {rel:.2e} >= {tol}"
    np.testing.assert_allclose(out, ref, rtol=tol, atol=tol * 4)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", sorted(CASES))
def test_matches_reference(mode, name):
    args, kwargs, knobs, dtype = make_case(name)
    out = prefill_triton.paged_prefill_attention(
        *args, **kwargs, interpret=mode == "interpret", **knobs
    )
    check(out, args, kwargs, dtype)


@pytest.mark.parametrize(
    "knobs",
    [
        {},
        dict(block_q=32, pages_per_block=4, num_warps=8),
        dict(block_q=16, pages_per_block=8, num_warps=4, num_stages=3),
    ],
)
@pytest.mark.parametrize("mode", [pytest.param("compiled", marks=GPU)])
def test_qwen3_shape_bf16(mode, knobs):
    """Qwen3-8B heads (32/8, H=128, page 16), chunks continuing cached prefixes, under several
    tile settings (compiled only: too large to interpret)."""
    rng = np.random.default_rng(12)
    N, K, H, ps, M = 32, 8, 128, 16, 40
    rows = [(300, 256), (256, 256), (0, 0), (613, 77)]  # (seq_len, chunk length)
    B, T = len(rows), 256
    P = B * M + 1
    tables = (1 + rng.permutation(B * M)).reshape(B, M).astype(np.int32)
    pos = np.zeros((B, T), np.int32)
    for b, (s, n) in enumerate(rows):
        pos[b, :n] = np.arange(s - n, s)
    args = (
        jnp.asarray(rng.standard_normal((B, T, N, H)), jnp.bfloat16),
        jnp.asarray(rng.standard_normal((2, P, K, ps, H)), jnp.bfloat16),
        jnp.asarray(rng.standard_normal((2, P, K, ps, H)), jnp.bfloat16),
        jnp.asarray(tables),
        jnp.asarray([s for s, _ in rows], jnp.int32),
        jnp.asarray(pos),
    )
    kwargs = dict(layer=1, scale=H**-0.5)
    check(
        prefill_triton.paged_prefill_attention(*args, **kwargs, **knobs), args, kwargs, "bfloat16"
    )


def test_causal_mask_is_applied():
    """Changing a key after a query's position leaves that query's output unchanged; changing
    one before it changes it (so the test above cannot pass with the mask off or inverted)."""
    args, kwargs, knobs, _ = make_case("p16_h64_g1_f32")
    q, k_pool, v_pool, bt, seq_lens, qpos = args
    run = lambda v: np.asarray(
        prefill_triton.paged_prefill_attention(  # noqa: E731
            q, k_pool, v, bt, seq_lens, qpos, **kwargs, interpret=True
        )
    )
    base = run(v_pool)
    page, slot = int(bt[0, 30 // 16]), 30 % 16  # row 0, key position 30 (of 37)
    changed = run(v_pool.at[kwargs["layer"], page, :, slot].add(10.0))
    np.testing.assert_array_equal(changed[0, :30], base[0, :30])  # queries at positions 0..29
    assert np.abs(changed[0, 30:37] - base[0, 30:37]).max() > 1e-2  # queries at 30..36 see it


def test_bad_input_raises():
    args, kwargs, _, _ = make_case("p16_h64_g1_f32")
    q, k_pool, v_pool, bt, seq_lens, qpos = args
    fn = prefill_triton.paged_prefill_attention
    with pytest.raises(ValueError, match=r"q must be \[B, T, N, H\]"):
        fn(q[:, 0], k_pool, v_pool, bt, seq_lens, qpos, **kwargs, interpret=True)
    with pytest.raises(ValueError, match="q_positions must be"):
        fn(q, k_pool, v_pool, bt, seq_lens, qpos[:, :3], **kwargs, interpret=True)
    with pytest.raises(ValueError, match="block_q=3"):
        fn(*args, **kwargs, interpret=True, block_q=3)
    with pytest.raises(ValueError, match="pages_per_block=3"):
        fn(*args, **kwargs, interpret=True, pages_per_block=3)
    with pytest.raises(ValueError, match="block_tables dtype"):
        fn(q, k_pool, v_pool, bt.astype(jnp.float32), seq_lens, qpos, **kwargs, interpret=True)
    # no query tokens: an empty result like the reference's, and the other arguments still checked
    out = fn(q[:, :0], k_pool, v_pool, bt, seq_lens, qpos[:, :0], **kwargs, interpret=True)
    ref = reference.paged_attention(q[:, :0], k_pool, v_pool, bt, seq_lens, qpos[:, :0], **kwargs)
    assert out.shape == ref.shape == (q.shape[0], 0, *q.shape[2:]) and out.dtype == q.dtype
    with pytest.raises(ValueError, match="seq_lens must be"):
        fn(q[:, :0], k_pool, v_pool, bt, seq_lens[:1], qpos[:, :0], **kwargs, interpret=True)


def test_model_prefill_with_kernel_matches_reference(monkeypatch):
    """A 3-layer Qwen3 prefill step (chunks continuing cached prefixes, ragged, padded) through
    `model_kernels` with ``prefill_attention="triton"`` equals the reference model step, and the L
    layer calls share one trace of the kernel (inner jit with a traced layer)."""
    import functools

    from jaxinfer import models
    from jaxinfer.config import KernelConfig, ModelConfig
    from jaxinfer.models import kernels
    from jaxinfer.models.kv_cache import KVCache

    kernel = functools.partial(prefill_triton.paged_prefill_attention, interpret=True)
    monkeypatch.setattr(kernels.registry, "get_prefill", lambda name: kernel)
    attn = kernels.model_kernels(KernelConfig("reference", "triton"))
    cfg = ModelConfig("qwen3", 256, 64, 96, 3, 4, 2, 16)
    params = models.init_params(cfg, jax.random.key(0), jnp.float32)
    params = jax.tree_util.tree_map(lambda p: p * 5.0 if p.ndim == 2 else p, params)
    rng = np.random.default_rng(0)
    page, M, rows = 4, 6, [(0, 9), (7, 5), (20, 3)]  # (cached tokens, chunk length)
    R, T = len(rows), max(n for _, n in rows)
    pages = rng.permutation(np.arange(1, 1 + R * M)).reshape(R, M).astype(np.int32)
    pool = (cfg.num_layers, 1 + R * M, cfg.num_kv_heads, page, cfg.head_dim)
    kv = KVCache(
        jnp.asarray(rng.standard_normal(pool), jnp.float32),
        jnp.asarray(rng.standard_normal(pool), jnp.float32),
        jnp.asarray(pages),
        jnp.asarray([c + n for c, n in rows], jnp.int32),
    )
    tok, pos, slot = (np.zeros((R, T), np.int32) for _ in range(3))
    for i, (c, n) in enumerate(rows):
        tok[i, :n] = rng.integers(0, cfg.vocab_size, n)
        pos[i, :n] = np.arange(c, c + n)
        slot[i, :n] = pages[i, pos[i, :n] // page] * page + pos[i, :n] % page
    args = (jnp.asarray(tok), jnp.asarray(pos), jnp.asarray(slot))

    def step(p, c, mk):
        return models.forward(p, cfg, *args, c, kernels=mk)

    jaxpr = jax.make_jaxpr(lambda p, c: step(p, c, attn))(params, kv).jaxpr
    layers = [e for e in jaxpr.eqns if e.params.get("name") == "decoder_layer"]
    assert len(layers) == cfg.num_layers  # one jitted layer body, the layer index an argument
    calls = [
        e
        for lay in layers
        for e in lay.params["jaxpr"].jaxpr.eqns
        if e.params.get("name") == "prefill_step"
    ]
    assert len(calls) == cfg.num_layers
    assert len({id(e.params["jaxpr"]) for e in calls}) == 1
    with jax.default_matmul_precision("highest"):
        h, kv_out = jax.jit(lambda p, c: step(p, c, attn))(params, kv)
        h_ref, kv_ref = jax.jit(lambda p, c: step(p, c, kernels.ModelKernels()))(params, kv)
    for i, (_, n) in enumerate(rows):  # real tokens only
        np.testing.assert_allclose(
            np.asarray(h[i, :n]), np.asarray(h_ref[i, :n]), rtol=1e-4, atol=1e-4
        )
    np.testing.assert_allclose(np.asarray(kv_out.k), np.asarray(kv_ref.k), rtol=1e-4, atol=1e-4)
