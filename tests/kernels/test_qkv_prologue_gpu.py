"""The fused attention prologue kernel compiled on a CUDA GPU vs the plain-jnp reference (tier
``gpu``): ``python3 -m pytest -m gpu tests/kernels/test_qkv_prologue_gpu.py -q -p no:cacheprovider``.

Cases: the CPU tier's table, plus Qwen3-8B's heads (32 query / 8 KV, H=128, page 16) in bf16 at
1, 64 and 256 tokens; and a jit with the pools donated must compile without a pool-sized copy.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels.qkv_prologue import reference, triton_pallas

from .test_qkv_prologue import CASES, check_prologue, layouts, make_inputs

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a CUDA GPU"),
]

QWEN3_8B = [(S, 32, 8, 128, 16, jnp.bfloat16, True) for S in (1, 64, 256)]


@pytest.mark.parametrize("S, N, K, H, page_size, dtype, norm", CASES + QWEN3_8B)
def test_compiled_matches_reference(S, N, K, H, page_size, dtype, norm):
    P = max(6, S // page_size + 3)
    qkv, qn, kn, cos, sin, slots, kp, vp = make_inputs(S, S=S, N=N, K=K, H=H, P=P,
                                                       page_size=page_size, dtype=dtype, norm=norm)
    kw = dict(layer=1, num_heads=N, num_kv_heads=K, eps=1e-6)
    # The GPU's cos/sin/rsqrt may differ from XLA's in the last float32 bit; after rounding to
    # bf16 that is at most one bf16 ulp (2^-7 relative).
    tol = 1e-5 if dtype == jnp.float32 else 2 ** -7
    for grid, rows in layouts(N, K):
        with jax.default_matmul_precision("highest"):
            ref = reference.qkv_prologue(qkv, qn, kn, cos, sin, slots, kp, vp, q_group_rows=rows,
                                         **kw)
        got = triton_pallas.qkv_prologue(qkv, qn, kn, cos, sin, slots, kp, vp, grid=grid,
                                         q_group_rows=rows, **kw)
        check_prologue(got, ref, tol, kp, slots, page_size)


def test_donated_pools_are_updated_in_place():
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
