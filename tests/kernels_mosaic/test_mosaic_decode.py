"""Mosaic GPU paged decode attention in GPU interpret mode (CPU) against the float32 reference.

What interpret mode covers here: the whole kernel (block-table copy, TMA page copies into the
multi-stage buffers, barriers, masks, online softmax, splits and the log-sum-exp combine), with the
two products done by jnp. What it cannot cover: the ``wgmma`` instructions themselves (the
interpreter implements neither transposed nor register wgmma operands) — those are exercised by
`test_mosaic_decode_gpu.py` (``-m gpu``) with the same sweep compiled.
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

needs_interpret = pytest.mark.skipif(
    not _HAS_INTERPRET, reason=f"jax {jax.__version__} has no Mosaic GPU interpret mode "
    "(jax._src.pallas.mosaic_gpu.interpret.params.InterpretGPUParams)")


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
    perm = np.asarray(jax.random.permutation(ks[3], np.arange(1, P)))[:B * M].reshape(B, M)
    lens = np.asarray(lens, np.int32)
    used = -(-lens // page_size)
    tables = np.where(np.arange(M)[None, :] < used[:, None], perm, 0).astype(np.int32)
    return q, k_pool, v_pool, jnp.asarray(tables), jnp.asarray(lens)


def ref_out(q, k_pool, v_pool, tables, lens, **kw):
    f32 = lambda x: x.astype(jnp.float32)
    return np.asarray(reference.paged_decode_attention(f32(q), f32(k_pool), f32(v_pool), tables,
                                                       lens, **kw))


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


@functools.lru_cache(maxsize=None)
def _jitted(interpret: bool, scale: float, soft_cap, window, cfg):
    def f(q, k, v, t, s, layer):
        return mosaic.paged_decode_attention(q, k, v, t, s, layer=layer, scale=scale,
                                             soft_cap=soft_cap, sliding_window=window,
                                             interpret=interpret, config=cfg)
    return jax.jit(f)


def run_case(interpret, seed, *, page_size, H, G, K=2, M=3, dtype=jnp.float32, layer=1,
             soft_cap=None, window=None, cfg=mosaic.MosaicDecodeConfig(), lens=None):
    max_len = M * page_size
    lens = lengths_for(page_size, max_len) if lens is None else lens
    q, k, v, t, s = make_inputs(seed, lens=lens, N=G * K, K=K, H=H, page_size=page_size, M=M,
                                dtype=dtype)
    scale = H ** -0.5
    out = _jitted(interpret, scale, soft_cap, window, cfg)(q, k, v, t, s, jnp.int32(layer))
    ref = ref_out(q, k, v, t, s, layer=layer, scale=scale, soft_cap=soft_cap,
                  sliding_window=window)
    rel = check(out, ref, dtype)
    padded = np.asarray(s) == 0
    assert np.all(np.asarray(out)[padded] == 0)
    return rel


# (page_size, H, G, dtype, M, num_splits): page sizes 16/32/64, head dims 64/128, GQA 1/2/4/8,
# fp32 and bf16; 64-key blocks so that rows span 1-3 blocks; one split (the pipeline ring) or
# automatic splits (here one block per program, then the log-sum-exp combine).
SWEEP = [
    (16, 64, 1, jnp.float32, 9, 1),
    (16, 128, 4, jnp.float32, 9, None),
    (64, 64, 8, jnp.float32, 3, 1),
    (64, 128, 2, jnp.bfloat16, 3, None),
    (16, 64, 8, jnp.bfloat16, 9, 1),
    (32, 128, 1, jnp.bfloat16, 5, 1),
]


@needs_interpret
@pytest.mark.parametrize("page_size,H,G,dtype,M,splits", SWEEP)
def test_sweep_interpret(page_size, H, G, dtype, M, splits):
    cfg = mosaic.MosaicDecodeConfig(block_kv=64, num_stages=2, num_splits=splits)
    run_case(True, 10 * page_size + G, page_size=page_size, H=H, G=G, dtype=dtype, M=M, cfg=cfg)


@needs_interpret
def test_splits_window_softcap_interpret():
    # 3 splits of 6 blocks, one of them cut by the window; soft cap on.
    for combine_kernel in (False, True):   # the splits combined by jnp, or by split_combine
        cfg = mosaic.MosaicDecodeConfig(block_kv=64, num_splits=3, combine_kernel=combine_kernel)
        run_case(True, 1, page_size=16, H=64, G=2, M=24, cfg=cfg, soft_cap=5.0, window=150,
                 lens=[1, 100, 383, 384, 0], layer=0)


@needs_interpret
def test_big_blocks_deep_pipeline_interpret():
    # 8 pages per step, 3 stages, more blocks than stages; and pages larger than a block.
    cfg = mosaic.MosaicDecodeConfig(block_kv=128, num_stages=3, num_splits=1)
    run_case(True, 2, page_size=16, H=64, G=4, M=40, cfg=cfg, lens=[640, 17, 129, 1])
    cfg = mosaic.MosaicDecodeConfig(block_kv=64, num_stages=2, num_splits=1)
    run_case(True, 3, page_size=128, H=64, G=2, M=3, cfg=cfg, lens=[1, 64, 65, 300, 384])


@needs_interpret
def test_layer_traced_in_scan_interpret():
    # The engine passes the layer as a traced i32[] (make_attention_fn's inner jit).
    lens = [33, 5, 0]
    q, k, v, t, s = make_inputs(7, lens=lens, N=4, K=2, H=64, page_size=16, M=3, L=2)
    scale = 64 ** -0.5

    def body(carry, layer):
        o = mosaic.paged_decode_attention(q, k, v, t, s, layer=layer, scale=scale,
                                          interpret=True)
        return carry, o
    _, outs = jax.jit(lambda: jax.lax.scan(body, 0, jnp.arange(2, dtype=jnp.int32)))()
    for layer in range(2):
        check(outs[layer], ref_out(q, k, v, t, s, layer=layer, scale=scale), jnp.float32)
    assert not np.allclose(np.asarray(outs[0]), np.asarray(outs[1]))


def grouped(q, K, rows=mosaic.Q_GROUP_MULTIPLE):
    """[B, N, H] -> [B, K, Gp, H], each KV head's G query rows zero-padded to a multiple of 8."""
    B, N, H = q.shape
    G = N // K
    Gp = -(-G // rows) * rows
    return jnp.pad(q.reshape(B, K, G, H), ((0, 0), (0, 0), (0, Gp - G), (0, 0)))


def grouped_case(interpret, G, splits, K=2, H=64):
    """A grouped, zero-padded q (what the qkv_prologue kernel writes) with the layer a Python int
    (its page offset then a constant) gives the reference's output, as [B, N, H] does."""
    page_size, M = 16, 5
    lens = [1, 17, 80, 0]
    q, k, v, t, s = make_inputs(20 + G, lens=lens, N=G * K, K=K, H=H, page_size=page_size, M=M,
                                dtype=jnp.bfloat16)
    kw = dict(scale=H ** -0.5, interpret=interpret, num_splits=splits)
    ref = ref_out(q, k, v, t, s, layer=1, scale=H ** -0.5)
    flat = mosaic.paged_decode_attention(q, k, v, t, s, layer=1, **kw)
    group = mosaic.paged_decode_attention(grouped(q, K), k, v, t, s, layer=1, num_heads=G * K,
                                          **kw)
    assert group.shape == q.shape
    check(flat, ref, jnp.bfloat16)
    check(group, ref, jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(group, np.float32), np.asarray(flat, np.float32))
    # the layer as a page-offset constant (how make_attention_fn passes it) reads the same pages
    off = mosaic.layer_offsets(1, k.shape[1])
    assert isinstance(off, np.ndarray) and len(set(off.tolist())) == off.size  # never uniform
    by_offset = mosaic.paged_decode_attention(grouped(q, K), k, v, t, s, layer=0,
                                              page_offset=off, num_heads=G * K, **kw)
    np.testing.assert_array_equal(np.asarray(by_offset, np.float32), np.asarray(group, np.float32))


@needs_interpret
@pytest.mark.parametrize("G, splits", [(4, None), (8, 1), (2, 2)])
def test_grouped_q_and_int_layer_interpret(G, splits):
    grouped_case(True, G, splits)


@pytest.mark.parametrize("q_shape, num_heads, match", [
    ((2, 2, 8, 64), None, "needs num_heads"),
    ((2, 2, 4, 64), 4, r"must be \[B, K=2, Gp=8, H\]"),
    ((2, 3, 8, 64), 6, r"must be \[B, K=2, Gp=8, H\]"),
    ((2, 4, 64), 8, "num_heads=8 but q"),
    ((2, 4), None, "must be \\[B, N, H\\] or grouped"),
])
def test_bad_grouped_q_raises(q_shape, num_heads, match):
    _, k, v, t, s = _shapes()
    with pytest.raises(ValueError, match=match):
        mosaic.paged_decode_attention(jnp.zeros(q_shape, jnp.bfloat16), k, v, t, s, scale=0.1,
                                      num_heads=num_heads)


@pytest.mark.parametrize("kw, match", [
    (dict(page_offset=np.zeros(32, np.float32)), r"page_offset must be i32\[32\]"),
    (dict(page_offset=[0] * 32), r"page_offset must be i32\[32\]"),
    (dict(layer=2), "layer=2 is outside the pools' L=2 layers"),
    (dict(layer=-1), "layer=-1 is outside"),
])
def test_bad_layer_or_offset_raises(kw, match):
    with pytest.raises(ValueError, match=match):
        mosaic.paged_decode_attention(*_shapes(), scale=0.1, **kw)


def test_bad_q_dtype_or_empty_batch_raises():
    q, k, v, t, s = _shapes()
    with pytest.raises(ValueError, match="q must be a floating dtype"):
        mosaic.paged_decode_attention(q.astype(jnp.int32), k, v, t, s, scale=0.1)
    q, k, v, t, s = _shapes(B=0)
    with pytest.raises(ValueError, match="B=0 rows"):
        mosaic.paged_decode_attention(q, k, v, t, s, scale=0.1)


@needs_interpret
def test_all_rows_padded_interpret():
    q, k, v, t, s = make_inputs(4, lens=[0, 0], N=2, K=1, H=64, page_size=16, M=2)
    out = mosaic.paged_decode_attention(q, k, v, t, s, scale=0.125, interpret=True)
    assert np.all(np.asarray(out) == 0)


def _shapes(B=2, N=4, K=2, H=64, page=16, M=3, L=2, dtype=jnp.bfloat16):
    return (jnp.zeros((B, N, H), dtype), jnp.zeros((L, 8, K, page, H), dtype),
            jnp.zeros((L, 8, K, page, H), dtype), jnp.zeros((B, M), jnp.int32),
            jnp.zeros((B,), jnp.int32))


@pytest.mark.parametrize("kw,match", [
    (dict(N=3), "multiple of num KV heads"),
    (dict(H=96), "multiple of 64"),
    (dict(page=12), "page_size=12"),
    (dict(dtype=jnp.float32), "float32 only in interpret"),
])
def test_bad_shapes_raise(kw, match):
    with pytest.raises(ValueError, match=match):
        mosaic.paged_decode_attention(*_shapes(**kw), scale=0.1)


@pytest.mark.parametrize("kw,match", [
    (dict(block_kv=48), "block_kv=48"),
    (dict(num_stages=0), "num_stages=0"),
    (dict(num_splits=0), "num_splits=0"),
    (dict(sliding_window=0), "sliding_window=0"),
    (dict(soft_cap=-1.0), "soft_cap=-1.0"),
])
def test_bad_knobs_raise(kw, match):
    with pytest.raises(ValueError, match=match):
        mosaic.paged_decode_attention(*_shapes(), scale=0.1, **kw)


@pytest.mark.parametrize("rows, max_blocks, expected", [
    (8, 16, 8),        # B=1, 8 KV heads, 1024 keys: 2 blocks per split, not 16 one-block splits
    (8, 1, 1),         # a single block: no split
    (8, 3, 1),
    (2048, 16, 2),     # B=256: 2 splits give 10.3 resident waves, 94% of the last one busy
    (64, 512, 12),     # B=8, 32768 keys: the wave rule, far under the cap
])
def test_pick_splits_waves_and_two_block_cap(rows, max_blocks, expected):
    cfg = mosaic.MosaicDecodeConfig(num_sms=132)
    smem = 70 * 1024                                    # 3 programs resident per multiprocessor
    got = mosaic._pick_splits(cfg, rows, max_blocks, smem)
    assert got == expected
    assert got <= max(1, max_blocks // 2)
    fixed = mosaic.MosaicDecodeConfig(num_splits=5)
    assert mosaic._pick_splits(fixed, rows, max_blocks, smem) == min(5, max_blocks)
