"""The attention prologue (q/k RMSNorm + RoPE + K/V page write) in plain jnp: against its parts
(`rms_norm`, `rope`, `write_kv`) applied one by one, and its argument checks (the model runs it,
and the model tests check the model against HF transformers)."""

from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.add_rms_norm.reference import rms_norm
from pallas_kernels.qkv_prologue import reference


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
        reference.qkv_prologue(**args, layer=0, num_heads=4, num_kv_heads=2)
