"""The fused attention prologue (q/k RMSNorm + RoPE + K/V page write): the Pallas kernel against
the plain-jnp reference in two modes (`modes.py`: interpret on the CPU, compiled on a CUDA GPU with
``-m gpu``), and the reference against its parts (`rms_norm`, `rope`, `write_kv`) applied one by
one on the model's [B, T, ...] shapes (the model runs the reference on its xla path, which the
model tests check against HF transformers)."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.add_rms_norm.reference import rms_norm
from pallas_kernels.qkv_prologue import reference, triton_pallas
from pallas_kernels.sizes import is_pow2

from .modes import GPU, runs


def make_inputs(seed, *, S, N, K, H, L=2, P=6, page_size=8, dtype=jnp.float32, norm=True):
    ks = jax.random.split(jax.random.key(seed), 6)
    qkv = jax.random.normal(ks[0], (S, (N + 2 * K) * H), jnp.float32).astype(dtype)
    qn = (1.0 + 0.1 * jax.random.normal(ks[1], (H,))).astype(dtype) if norm else None
    kn = (1.0 + 0.1 * jax.random.normal(ks[2], (H,))).astype(dtype) if norm else None
    pos = jax.random.randint(ks[3], (S,), 0, 4096)
    inv = 1.0 / (10000.0 ** (jnp.arange(0, H, 2, dtype=jnp.float32) / H))
    ang = pos.astype(jnp.float32)[:, None] * inv
    # distinct slots outside the null page, so every write is visible and none overlaps
    slots = jax.random.permutation(ks[4], (P - 1) * page_size)[:S] + page_size
    pools = jax.random.normal(ks[5], (2, L, P, K, page_size, H), jnp.float32).astype(dtype)
    return qkv, qn, kn, jnp.cos(ang), jnp.sin(ang), slots.astype(jnp.int32), pools[0], pools[1]


CASES = [  # (S, N, K, H, page_size, dtype, norm)
    (1, 4, 2, 64, 8, jnp.float32, True),
    (5, 8, 2, 128, 16, jnp.float32, True),
    (3, 6, 3, 64, 8, jnp.float32, False),      # Llama: no QK-Norm, K=3 (SmolLM2's grouping)
    (4, 4, 4, 32, 8, jnp.bfloat16, True),
    (2, 8, 1, 64, 16, jnp.bfloat16, False),
]
QWEN3_8B = [(S, 32, 8, 128, 16, jnp.bfloat16, True) for S in (1, 64, 256)]   # compiled only

def layouts(N, K):
    """(grid, q_group_rows) pairs the kernel takes for these heads: the per-head grid always;
    the grouped grid where K and the rows per group are powers of 2; q unpadded, and padded to
    8 rows (the Mosaic decode kernel's layout) and to 16 (rows read past the array, masked)."""
    G = N // K
    out = [("head", None), ("head", 8 if G <= 8 else None)]
    for rows in (None, 8, 16):
        if (rows is None or rows >= G) and is_pow2(K) and is_pow2(rows or G):
            out.append(("group", rows))
    return out


def check_prologue(got, ref, tol, kp, slots, page_size, layer=1):
    """The kernel's (q, k_pool, v_pool) against the reference's; nothing outside the written
    slots of ``layer`` changed."""
    (q_k, k_k, v_k), (q_r, k_r, v_r) = got, ref
    assert q_k.shape == q_r.shape
    for g, r in ((q_k, q_r), (k_k, k_r)):
        g, r = np.asarray(g, np.float32), np.asarray(r, np.float32)
        assert np.all(np.isfinite(g))
        np.testing.assert_allclose(g, r, rtol=tol, atol=tol)
    np.testing.assert_array_equal(np.asarray(v_k, np.float32), np.asarray(v_r, np.float32))
    changed = np.asarray(k_k != kp).any(axis=(2, 4))             # [L, P, page_size]
    written = np.zeros_like(changed)
    written[layer, np.asarray(slots) // page_size, np.asarray(slots) % page_size] = True
    assert not (changed & ~written).any()
    assert changed[written].mean() > 0.9


@pytest.mark.parametrize("mode, case", runs(CASES, QWEN3_8B))
def test_kernel_matches_reference(mode, case):
    S, N, K, H, page_size, dtype, norm = case
    P = max(6, S // page_size + 3)
    qkv, qn, kn, cos, sin, slots, kp, vp = make_inputs(S, S=S, N=N, K=K, H=H, P=P,
                                                       page_size=page_size, dtype=dtype, norm=norm)
    kw = dict(layer=1, num_heads=N, num_kv_heads=K, eps=1e-6)
    # Interpret: the same operations in the same order and precision, equal up to one rounding
    # of the dtype. Compiled: the GPU's cos/sin/rsqrt may differ from XLA's in the last float32
    # bit; after rounding to bf16 that is at most one bf16 ulp (2^-7 relative).
    if mode == "interpret":
        tol = 1e-6 if dtype == jnp.float32 else 1e-2
    else:
        tol = 1e-5 if dtype == jnp.float32 else 2 ** -7
    for grid, rows in layouts(N, K):
        with jax.default_matmul_precision("highest"):
            ref = reference.qkv_prologue(qkv, qn, kn, cos, sin, slots, kp, vp, q_group_rows=rows,
                                         **kw)
        got = triton_pallas.qkv_prologue(qkv, qn, kn, cos, sin, slots, kp, vp,
                                         interpret=mode == "interpret", grid=grid,
                                         q_group_rows=rows, **kw)
        check_prologue(got, ref, tol, kp, slots, page_size)
        if rows is not None:
            assert not np.asarray(got[0][:, :, N // K:]).any(), "padding rows must be zero"


@pytest.mark.parametrize("mode", [pytest.param("compiled", marks=GPU)])
def test_donated_pools_are_updated_in_place(mode):
    """A jit with the pools donated compiles without a pool-sized copy (the pools are aliased to
    the outputs)."""
    S, N, K, H, ps = 4, 32, 8, 128, 16
    qkv, qn, kn, cos, sin, slots, kp, vp = make_inputs(0, S=S, N=N, K=K, H=H, L=4, P=64,
                                                       page_size=ps, dtype=jnp.bfloat16)

    def step(kp, vp, layer):
        return triton_pallas.qkv_prologue(qkv, qn, kn, cos, sin, slots, kp, vp, layer=layer,
                                          num_heads=N, num_kv_heads=K)

    hlo = jax.jit(step, donate_argnums=(0, 1)).lower(kp, vp, jnp.int32(2)).compile().as_text()
    pool = "bf16[" + ",".join(map(str, kp.shape)) + "]"
    copies = [ln for ln in hlo.splitlines() if re.search(r"\bcopy(-start)?\(", ln) and pool in ln]
    assert not copies, f"pool-sized copies in the compiled step: {copies[:2]}"


def test_grouped_layout_is_the_reference_q_padded():
    """q_group_rows=Gq gives the same values as [S, N, H], grouped by KV head and zero-padded."""
    S, N, K, H = 3, 8, 2, 64
    qkv, qn, kn, cos, sin, slots, kp, vp = make_inputs(5, S=S, N=N, K=K, H=H)
    kw = dict(layer=0, num_heads=N, num_kv_heads=K)
    flat = reference.qkv_prologue(qkv, qn, kn, cos, sin, slots, kp, vp, **kw)[0]
    grouped = reference.qkv_prologue(qkv, qn, kn, cos, sin, slots, kp, vp, q_group_rows=8,
                                     **kw)[0]
    assert grouped.shape == (S, K, 8, H)
    np.testing.assert_array_equal(np.asarray(grouped[:, :, :4]), np.asarray(flat).reshape(S, K, 4, H))
    assert not np.asarray(grouped[:, :, 4:]).any()


def test_traced_layer_under_jit_interpret():
    qkv, qn, kn, cos, sin, slots, kp, vp = make_inputs(7, S=2, N=4, K=2, H=64)
    kw = dict(num_heads=4, num_kv_heads=2, eps=1e-6)

    @jax.jit
    def both(layer):
        return (reference.qkv_prologue(qkv, qn, kn, cos, sin, slots, kp, vp, layer=layer, **kw),
                triton_pallas.qkv_prologue(qkv, qn, kn, cos, sin, slots, kp, vp, layer=layer,
                                           interpret=True, **kw))

    for layer in (0, 1):
        ref, got = both(jnp.int32(layer))
        for r, g in zip(ref, got):
            np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("norm", [True, False])
def test_reference_matches_model_functions(norm):
    """The reference against its rms_norm / rope / write_kv applied one by one on [1, S, ...]."""
    S, N, K, H, ps = 3, 8, 2, 64, 8
    qkv, qn, kn, cos, sin, slots, kp, vp = make_inputs(11, S=S, N=N, K=K, H=H, page_size=ps,
                                                       dtype=jnp.bfloat16, norm=norm)
    q_r, k_r, v_r = reference.qkv_prologue(qkv, qn, kn, cos, sin, slots, kp, vp, layer=0,
                                           num_heads=N, num_kv_heads=K, eps=1e-6)
    qk = qkv[:, :(N + K) * H].reshape(1, S, N + K, H)
    v = qkv[:, (N + K) * H:].reshape(1, S, K, H)
    if norm:
        w = jnp.concatenate([jnp.broadcast_to(qn, (N, H)), jnp.broadcast_to(kn, (K, H))])
        qk = rms_norm(qk, w, 1e-6)
    qk = reference.rope(qk, cos[None], sin[None])
    k_m, v_m = reference.write_kv(kp, vp, 0, qk[0, :, N:], v[0], slots)
    np.testing.assert_array_equal(np.asarray(q_r, np.float32), np.asarray(qk[0, :, :N], np.float32))
    np.testing.assert_array_equal(np.asarray(k_r, np.float32), np.asarray(k_m, np.float32))
    np.testing.assert_array_equal(np.asarray(v_r, np.float32), np.asarray(v_m, np.float32))


@pytest.mark.parametrize("change, match", [
    (dict(qkv=jnp.zeros((2, 100))), "qkv must be"),
    (dict(cos=jnp.zeros((2, 7))), "cos must be"),
    (dict(slot_mapping=jnp.zeros((3,), jnp.int32)), "slot_mapping must be"),
    (dict(k_norm=None), "given together"),
    (dict(q_norm=jnp.ones((5,))), "q_norm must be"),
    (dict(slot_mapping=jnp.asarray([8.7, 9.7])), "slot_mapping must be i32"),
    (dict(qkv=jnp.zeros((2, 512), jnp.int32)), "qkv must be a floating dtype"),
])
def test_bad_args_raise(change, match):
    qkv, qn, kn, cos, sin, slots, kp, vp = make_inputs(0, S=2, N=4, K=2, H=64)
    args = dict(qkv=qkv, q_norm=qn, k_norm=kn, cos=cos, sin=sin, slot_mapping=slots,
                k_pool=kp, v_pool=vp)
    args.update(change)
    with pytest.raises(ValueError, match=match):
        triton_pallas.qkv_prologue(**args, layer=0, num_heads=4, num_kv_heads=2, interpret=True)


@pytest.mark.parametrize("kw, match", [
    (dict(grid="rows"), "grid='rows' is not one of"),
    (dict(grid="group", num_heads=6, num_kv_heads=3), "grid='group' needs the KV heads K"),
    (dict(q_group_rows=1), "q_group_rows=1 must be an integer >="),
    (dict(q_group_rows=4.0), "q_group_rows=4.0 must be an integer >="),
    (dict(grid="group", num_heads=12, num_kv_heads=3), "got K=3, rows=4"),
])
def test_bad_layout_raises(kw, match):
    N, K = kw.pop("num_heads", 4), kw.pop("num_kv_heads", 2)
    qkv, qn, kn, cos, sin, slots, kp, vp = make_inputs(0, S=2, N=N, K=K, H=64)
    with pytest.raises(ValueError, match=match):
        triton_pallas.qkv_prologue(qkv, qn, kn, cos, sin, slots, kp, vp, layer=0, num_heads=N,
                                   num_kv_heads=K, interpret=True, **kw)


@pytest.mark.parametrize("rows", [None, 8])
def test_zero_tokens_like_the_reference(rows):
    qkv, qn, kn, cos, sin, slots, kp, vp = make_inputs(0, S=1, N=8, K=2, H=64)
    kw = dict(layer=0, num_heads=8, num_kv_heads=2, q_group_rows=rows)
    args = (qkv[:0], qn, kn, cos[:0], sin[:0], slots[:0], kp, vp)
    got = triton_pallas.qkv_prologue(*args, interpret=True, **kw)
    want = reference.qkv_prologue(*args, **kw)
    assert got[0].shape == want[0].shape and got[0].shape[0] == 0
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(kp))


def test_head_dim_half_not_pow2_raises():
    qkv, qn, kn, cos, sin, slots, kp, vp = make_inputs(0, S=1, N=2, K=1, H=64)
    H = 96
    kp = jnp.zeros((2, 6, 1, 8, H)); vp = kp
    qkv = jnp.zeros((1, 4 * H)); cos = sin = jnp.zeros((1, H // 2))
    with pytest.raises(ValueError, match="power of 2"):
        triton_pallas.qkv_prologue(qkv, None, None, cos, sin, slots[:1], kp, vp, layer=0,
                                   num_heads=2, num_kv_heads=1, interpret=True)
