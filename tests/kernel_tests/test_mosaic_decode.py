"""Mosaic GPU paged decode attention against the float32 reference, one suite run in two modes:
GPU interpret mode on the CPU and compiled on a Hopper GPU (``-m gpu``).

Interpret mode covers the whole kernel (block-table copy, TMA page copies into the multi-stage
buffers, barriers, masks, online softmax, splits and the log-sum-exp combine) with the two products
done by jnp: the interpreter implements neither transposed nor register ``wgmma`` operands, which
the compiled mode exercises (in bf16/f16: compiled float32 is rejected). Argument checks, the
split count and the split combine: test_mosaic_decode_args_splits.py.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.paged_attention import mosaic, reference

try:
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams  # noqa: F401

    _HAS_INTERPRET = True
except ImportError:  # pragma: no cover - depends on the installed jax
    _HAS_INTERPRET = False


def _is_hopper() -> bool:
    try:
        d = jax.devices()[0]
    except RuntimeError:
        return False
    return d.platform == "gpu" and getattr(d, "compute_capability", "") in ("9.0", "9.0a")


needs_interpret = pytest.mark.skipif(
    not _HAS_INTERPRET,
    reason=f"jax {jax.__version__} has no Mosaic GPU interpret mode "
    "(jax._src.pallas.mosaic_gpu.interpret.params.InterpretGPUParams)",
)
HOPPER = [
    pytest.mark.gpu,
    pytest.mark.skipif(not _is_hopper(), reason="needs a Hopper (sm_90) GPU"),
]


def by_mode(interpret_cases, compiled_cases):
    """``(mode, case)`` parameters, sizes per mode (compiled: bf16/f16, real head counts)."""
    return [pytest.param("interpret", c, marks=needs_interpret) for c in interpret_cases] + [
        pytest.param("compiled", c, marks=HOPPER) for c in compiled_cases
    ]


def lengths_for(page_size: int, max_len: int) -> list[int]:
    """Edge lengths: 1, page-1, page, page+1, an odd one, the maximum, and a padded row (0)."""
    odd = (max_len // 2) | 1
    return [1, page_size - 1, page_size, page_size + 1, odd, max_len, 0]


def make_inputs(seed: int, *, lens, N, K, H, page_size, M, L=2, dtype=jnp.float32):
    """Random q and pools; each row's pages are a random permutation of distinct pages (not 0)."""
    B = len(lens)
    P = B * M + 3
    ks = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(ks[0], (B, N, H), jnp.float32).astype(dtype)
    k_pool = jax.random.normal(ks[1], (L, P, K, page_size, H), jnp.float32).astype(dtype)
    v_pool = jax.random.normal(ks[2], (L, P, K, page_size, H), jnp.float32).astype(dtype)
    perm = np.asarray(jax.random.permutation(ks[3], np.arange(1, P)))[: B * M].reshape(B, M)
    lens = np.asarray(lens, np.int32)
    used = -(-lens // page_size)
    tables = np.where(np.arange(M)[None, :] < used[:, None], perm, 0).astype(np.int32)
    return q, k_pool, v_pool, jnp.asarray(tables), jnp.asarray(lens)


def ref_out(q, k_pool, v_pool, tables, lens, **kw):
    f32 = lambda x: x.astype(jnp.float32)
    return np.asarray(
        reference.paged_decode_attention(f32(q), f32(k_pool), f32(v_pool), tables, lens, **kw)
    )


def check(out, ref, dtype):
    out = np.asarray(out, np.float32)
    assert out.shape == ref.shape
    assert np.all(np.isfinite(out))
    rel = np.linalg.norm(out - ref) / np.linalg.norm(ref)
    err = np.max(np.abs(out - ref))
    if jnp.dtype(dtype) == jnp.float32:
        assert rel < 2e-6 and err < 1e-5, (rel, err)
    else:  # bf16 inputs and bf16 P in the P.V product: ~2^-9 relative per term
        assert rel < 1e-2 and err < 5e-2, (rel, err)
    return rel


@functools.cache
def _jitted(interpret: bool, scale: float, soft_cap, window, cfg):
    def f(q, k, v, t, s, layer):
        return mosaic.paged_decode_attention(
            q,
            k,
            v,
            t,
            s,
            layer=layer,
            scale=scale,
            soft_cap=soft_cap,
            sliding_window=window,
            interpret=interpret,
            config=cfg,
        )

    return jax.jit(f)


def run_case(
    mode,
    seed,
    *,
    page_size,
    H,
    G,
    K=2,
    M=3,
    dtype=jnp.float32,
    layer=1,
    soft_cap=None,
    window=None,
    cfg=mosaic.MosaicDecodeConfig(),
    lens=None,
):
    max_len = M * page_size
    lens = lengths_for(page_size, max_len) if lens is None else lens
    q, k, v, t, s = make_inputs(
        seed, lens=lens, N=G * K, K=K, H=H, page_size=page_size, M=M, dtype=dtype
    )
    scale = H**-0.5
    out = jax.block_until_ready(  # interpret mode: no dispatch while its callbacks run
        _jitted(mode == "interpret", scale, soft_cap, window, cfg)(q, k, v, t, s, jnp.int32(layer))
    )
    ref = ref_out(q, k, v, t, s, layer=layer, scale=scale, soft_cap=soft_cap, sliding_window=window)
    rel = check(out, ref, dtype)
    padded = np.asarray(s) == 0
    assert np.all(np.asarray(out)[padded] == 0)
    return rel


# (page_size, H, G, dtype, M, num_splits, block_kv): page sizes 16/32/64, head dims 64/128, GQA
# 1/2/4/8; rows span 1-3 blocks (interpret) or more; one split (the pipeline ring) or automatic
# splits (then the log-sum-exp combine).
SWEEP_INTERPRET = [
    (16, 64, 1, jnp.float32, 9, 1, 64),
    (16, 128, 4, jnp.float32, 9, None, 64),
    (64, 64, 8, jnp.float32, 3, 1, 64),
    (64, 128, 2, jnp.bfloat16, 3, None, 64),
    (32, 128, 1, jnp.bfloat16, 5, 1, 64),
]
SWEEP_COMPILED = [
    (16, 64, 1, jnp.bfloat16, 9, 1, 64),
    (16, 128, 4, jnp.bfloat16, 9, None, 64),
    (64, 64, 8, jnp.float16, 3, 1, 64),
    (64, 128, 2, jnp.bfloat16, 5, None, 128),
    (16, 64, 8, jnp.float16, 40, 1, 128),
    (32, 128, 1, jnp.bfloat16, 5, 1, 64),
    (32, 128, 8, jnp.bfloat16, 20, 1, 128),
]


@pytest.mark.parametrize("mode, case", by_mode(SWEEP_INTERPRET, SWEEP_COMPILED))
def test_sweep(mode, case):
    page_size, H, G, dtype, M, splits, block_kv = case
    cfg = mosaic.MosaicDecodeConfig(block_kv=block_kv, num_stages=2, num_splits=splits)
    run_case(mode, 10 * page_size + G, page_size=page_size, H=H, G=G, dtype=dtype, M=M, cfg=cfg)


@pytest.mark.parametrize(
    "mode, case",
    by_mode([dict(H=64, G=2, dtype=jnp.float32)], [dict(H=128, G=4, dtype=jnp.bfloat16)]),
)
def test_splits_window_softcap(mode, case):
    # 3 splits of 6 blocks, one of them cut by the window; soft cap on.
    cfg = mosaic.MosaicDecodeConfig(block_kv=64, num_splits=3)
    run_case(
        mode,
        1,
        page_size=16,
        M=24,
        cfg=cfg,
        soft_cap=5.0,
        window=150,
        lens=[1, 100, 383, 384, 0],
        layer=0,
        **case,
    )


PIPELINES_INTERPRET = [  # 8 pages per step, 3 stages, more blocks than stages; pages > a block
    dict(block_kv=128, stages=3, splits=1, page_size=16, H=64, G=4, M=40, lens=[640, 17, 129, 1]),
    dict(
        block_kv=64, stages=2, splits=1, page_size=128, H=64, G=2, M=3, lens=[1, 64, 65, 300, 384]
    ),
]
PIPELINES_COMPILED = [
    dict(
        block_kv=bk,
        stages=st,
        splits=2,
        page_size=ps,
        H=128,
        G=4,
        M=1280 // ps,
        lens=[1280, 17, 129, 1, 0, 1000],
        dtype=jnp.bfloat16,
    )
    for bk, st, ps in [(128, 3, 16), (64, 4, 16), (64, 2, 128)]
]


@pytest.mark.parametrize("mode, case", by_mode(PIPELINES_INTERPRET, PIPELINES_COMPILED))
def test_pipeline_shapes(mode, case):
    case = dict(case)
    cfg = mosaic.MosaicDecodeConfig(
        block_kv=case.pop("block_kv"), num_stages=case.pop("stages"), num_splits=case.pop("splits")
    )
    run_case(mode, 2, cfg=cfg, **case)


@pytest.mark.parametrize("mode", [pytest.param("compiled", marks=HOPPER)])
def test_qwen3_heads_long_ragged(mode):
    # N=32, K=8, H=128, page 16; lengths up to 4096, automatic splits.
    run_case(
        mode,
        5,
        page_size=16,
        H=128,
        G=4,
        K=8,
        M=256,
        dtype=jnp.bfloat16,
        lens=[4096, 1, 2049, 0, 777, 4095, 16, 3000],
    )


@pytest.mark.parametrize(
    "mode, case",
    by_mode(
        [dict(lens=[33, 5, 0], N=4, K=2, H=64, M=3, dtype=jnp.float32)],
        [dict(lens=[33, 5, 0, 200], N=16, K=4, H=128, M=13, dtype=jnp.bfloat16)],
    ),
)
def test_layer_traced_in_scan(mode, case):
    # The engine passes the layer as a traced i32[] (the attention dispatch's inner jit).
    q, k, v, t, s = make_inputs(7, page_size=16, L=2, **case)
    scale = case["H"] ** -0.5

    def body(carry, layer):
        return carry, mosaic.paged_decode_attention(
            q, k, v, t, s, layer=layer, scale=scale, interpret=mode == "interpret"
        )

    _, outs = jax.block_until_ready(
        jax.jit(lambda: jax.lax.scan(body, 0, jnp.arange(2, dtype=jnp.int32)))()
    )
    for layer in range(2):
        check(outs[layer], ref_out(q, k, v, t, s, layer=layer, scale=scale), case["dtype"])
    assert not np.allclose(np.asarray(outs[0]), np.asarray(outs[1]))


@pytest.mark.parametrize(
    "mode, case",
    by_mode(
        [(4, None, 2, 64)],  # padded rows and automatic splits; G=8 and forced splits run compiled
        [(4, None, 8, 128), (8, 1, 2, 64), (2, 2, 2, 128)],
    ),
)
def test_int_layer_and_page_offset(mode, case):
    """The layer as a Python int, and as its page-offset constant (how the attention dispatch
    passes it), gives the reference's output; G query rows are zero-padded to a multiple of 8."""
    G, splits, K, H = case
    q, k, v, t, s = make_inputs(
        20 + G, lens=[1, 17, 80, 0], N=G * K, K=K, H=H, page_size=16, M=5, dtype=jnp.bfloat16
    )
    kw = dict(scale=H**-0.5, interpret=mode == "interpret", num_splits=splits)
    out = mosaic.paged_decode_attention(q, k, v, t, s, layer=1, **kw)
    check(out, ref_out(q, k, v, t, s, layer=1, scale=H**-0.5), jnp.bfloat16)
    off = mosaic.layer_offsets(1, k.shape[1])
    assert isinstance(off, np.ndarray) and len(set(off.tolist())) == off.size  # never uniform
    by_offset = mosaic.paged_decode_attention(q, k, v, t, s, layer=0, page_offset=off, **kw)
    np.testing.assert_array_equal(np.asarray(by_offset, np.float32), np.asarray(out, np.float32))


@needs_interpret
def test_all_rows_padded_interpret():
    q, k, v, t, s = make_inputs(4, lens=[0, 0], N=2, K=1, H=64, page_size=16, M=2)
    out = mosaic.paged_decode_attention(q, k, v, t, s, scale=0.125, interpret=True)
    assert np.all(np.asarray(out) == 0)
