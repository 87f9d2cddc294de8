"""Mosaic GPU paged prefill attention (`prefill_mosaic`) against the float32 reference, one suite
run in two modes: GPU interpret mode on the CPU (float32, and one bfloat16 case) and compiled on a
Hopper GPU (``-m gpu``: bfloat16/float16, with the real wgmma products).

Each row is a prefill chunk: its queries are the last ``n`` positions of ``seq_len`` keys, padded
to T with position -1 (or 0, as the engine pads them); a row with seq_len 0 is a padded row.
Random data everywhere (page 0 included), permuted block tables. Cases cover page sizes smaller
than, equal to and larger than a key block, GQA groups 1-8 and an odd one (3: 63 of 64 wgmma rows),
query tiles split over several programs, a sliding window with a soft cap, the layer traced inside
a jit, and `ragged.ragged_paged_attention` tiles through the kernel. Argument checks: ValueError.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.paged_attention import prefill_mosaic, ragged, reference

from .test_mosaic_decode import HOPPER, check, needs_interpret
from .test_ragged_attention import CASES as RAGGED_CASES
from .test_ragged_attention import _case as ragged_case


def make_case(seed, rows, *, page_size, H, N, K, M, L=2, dtype=jnp.float32, pad=-1):
    """(q, k_pool, v_pool, tables, seq_lens, q_positions) for rows [(seq_len, n)]: T = max n;
    row b's tokens at positions seq_len - n .. seq_len - 1, then ``pad``."""
    rng = np.random.default_rng(seed)
    B, T, P = len(rows), max(n for _, n in rows), len(rows) * M + 3
    lens = np.array([s for s, _ in rows], np.int32)
    pages = rng.permutation(np.arange(1, P))[: B * M].reshape(B, M).astype(np.int32)
    used = -(-lens // page_size)
    tables = np.where(np.arange(M)[None, :] < used[:, None], pages, 0).astype(np.int32)
    pos = np.full((B, T), pad, np.int32)
    for b, (s, n) in enumerate(rows):
        pos[b, :n] = np.arange(s - n, s)
    arrays = (
        rng.standard_normal((B, T, N, H)),
        rng.standard_normal((L, P, K, page_size, H)),
        rng.standard_normal((L, P, K, page_size, H)),
    )
    return (*(jnp.asarray(a, dtype) for a in arrays), *map(jnp.asarray, (tables, lens, pos)))


def ref_out(args, **kw):
    """The float32 reference on the same (already rounded) inputs."""
    f32 = [a.astype(jnp.float32) if jnp.issubdtype(a.dtype, jnp.floating) else a for a in args]
    with jax.default_matmul_precision("highest"):
        return np.asarray(reference.paged_attention(*f32, **kw))


@functools.cache
def _jitted(interpret: bool, scale: float, knobs: tuple):
    """The kernel under jit with the layer traced (as the engine's prefill step calls it)."""

    def f(q, k, v, t, s, pos, layer):
        return prefill_mosaic.paged_prefill_attention(
            q, k, v, t, s, pos, layer=layer, scale=scale, interpret=interpret, **dict(knobs)
        )

    return jax.jit(f)


def run_case(mode, case, dtype):
    case = dict(case)
    rows, layer, knobs = case.pop("rows"), case.pop("layer", 1), case.pop("knobs", {})
    args = make_case(len(rows) + case["N"], rows, dtype=dtype, **case)
    scale = case["H"] ** -0.5
    fn = _jitted(mode == "interpret", scale, tuple(sorted(knobs.items())))
    out = jax.block_until_ready(fn(*args, jnp.int32(layer)))
    assert out.shape == args[0].shape and out.dtype == args[0].dtype
    extra = {k: v for k, v in knobs.items() if k in ("soft_cap", "sliding_window")}
    check(out, ref_out(args, layer=layer, scale=scale, **extra), dtype)
    assert np.all(np.asarray(out, np.float32)[np.asarray(args[4]) == 0] == 0)  # seq_len 0 rows
    return args, out


def _c(page_size, H, N, K, M, rows, **rest):
    """A case: pages of ``page_size``, head dim H, N query / K KV heads, tables of M pages, rows
    [(seq_len, n)]; rest: knobs (kernel keywords), layer, pad."""
    return dict(page_size=page_size, H=H, N=N, K=K, M=M, rows=rows, **rest)


CASES = {  # rows cross page and 64-key block edges; (0, 0): a padded row
    "p16_g4_tile64": _c(16, 64, 8, 2, 5, [(37, 16), (70, 5), (0, 0), (16, 16)]),
    "p8_g2_window_softcap": _c(
        8, 64, 4, 2, 12, [(90, 12), (9, 9), (40, 1)], knobs=dict(sliding_window=20, soft_cap=5.0)
    ),
    # pages larger than a key block; 8 tokens per program, so 2 programs per row
    "p128_g8_two_tiles_3_stages": _c(
        128, 128, 16, 2, 2, [(200, 14), (0, 0), (129, 3)], knobs=dict(num_stages=3), layer=0
    ),
    # 21 tokens x 3 heads = 63 of 64 rows; engine-style padding (position 0)
    "p16_g3_odd_group_pad0": _c(16, 64, 6, 2, 4, [(50, 22), (7, 7)], pad=0),
    # 8 pages a pipeline step, more key blocks than stages
    "p16_g1_bkv128_long": _c(16, 64, 2, 2, 32, [(500, 4), (129, 2)], knobs=dict(block_kv=128)),
}
GPU_CASES = {  # compiled only: Qwen3-8B heads (32/8, H=128, page 16), long chunks
    "qwen3_chunks": _c(16, 128, 32, 8, 48, [(700, 256), (256, 256), (0, 0), (613, 77), (1, 1)]),
    "qwen3_window_softcap_bkv128": _c(
        16,
        128,
        32,
        8,
        48,
        [(700, 100), (300, 300)],
        knobs=dict(sliding_window=128, soft_cap=30.0, block_kv=128, num_stages=3),
    ),
}


def by_mode():
    """Every case interpreted in float32; every case (and `GPU_CASES`) compiled in bfloat16, one
    in float16."""
    out = [pytest.param("interpret", n, jnp.float32, marks=needs_interpret) for n in CASES]
    out.append(pytest.param("interpret", "p16_g4_tile64", jnp.bfloat16, marks=needs_interpret))
    out += [pytest.param("compiled", n, jnp.bfloat16, marks=HOPPER) for n in [*CASES, *GPU_CASES]]
    out.append(pytest.param("compiled", "p16_g4_tile64", jnp.float16, marks=HOPPER))
    return out


@pytest.mark.parametrize("mode, name, dtype", by_mode())
def test_matches_reference(mode, name, dtype):
    run_case(mode, {**CASES, **GPU_CASES}[name], dtype)


@pytest.mark.parametrize(
    "mode",
    [pytest.param("interpret", marks=needs_interpret), pytest.param("compiled", marks=HOPPER)],
)
def test_causal_mask_is_applied(mode):
    """A value changed at key position 30 of row 0 changes exactly its queries at >= 30. The first
    call is eager with a Python-int layer (constant page offset), the second jitted (traced)."""
    case = dict(page_size=16, H=64, N=8, K=2, M=3)
    q, k, v, t, s, pos = make_case(0, [(37, 16), (5, 5)], **case)
    dtype = jnp.float32 if mode == "interpret" else jnp.bfloat16
    q, k, v = (x.astype(dtype) for x in (q, k, v))
    fn = _jitted(mode == "interpret", 0.125, ())
    base = prefill_mosaic.paged_prefill_attention(
        q, k, v, t, s, pos, layer=1, scale=0.125, interpret=mode == "interpret"
    )
    base = np.asarray(base, np.float32)
    v2 = v.at[1, int(t[0, 1]), :, 30 - 16].add(10.0)
    changed = np.asarray(fn(q, k, v2, t, s, pos, jnp.int32(1)), np.float32)
    np.testing.assert_array_equal(changed[0, :9], base[0, :9])  # positions 21..29
    assert np.all(np.abs(changed[0, 9:16] - base[0, 9:16]).max(axis=(1, 2)) > 1e-2)
    np.testing.assert_array_equal(changed[1], base[1])


@pytest.mark.parametrize(
    "mode, q_lens, kv_lens",
    [pytest.param("interpret", *c, marks=needs_interpret) for c in RAGGED_CASES[:1]]
    + [pytest.param("compiled", *c, marks=HOPPER) for c in RAGGED_CASES],
)
def test_ragged_tiles_through_kernel(mode, q_lens, kv_lens):
    """`ragged.ragged_paged_attention` (block_q=16 tiles: 64 wgmma rows at G=4) with this kernel
    as ``attention`` equals the token-by-token reference on the real tokens."""
    dtype = jnp.float32 if mode == "interpret" else jnp.bfloat16
    args = ragged_case(
        np.random.default_rng(3), q_lens, kv_lens, T=64, R=8, N=8, K=2, H=64, dtype=dtype
    )
    kernel = functools.partial(
        prefill_mosaic.paged_prefill_attention, interpret=mode == "interpret"
    )
    fn = jax.jit(
        functools.partial(ragged.ragged_paged_attention, attention=kernel, scale=0.2, block_q=16)
    )
    used = sum(q_lens)
    out = np.asarray(fn(*args, layer=jnp.int32(1)), np.float32)[:used]
    f32 = [a.astype(jnp.float32) if a.dtype == dtype else a for a in args]
    want = np.asarray(reference.ragged_paged_attention(*f32, layer=1, scale=0.2))[:used]
    check(out, want, dtype)


def test_no_queries_gives_an_empty_result():
    q, k, v, t, s, pos = make_case(1, [(5, 5), (3, 3)], page_size=16, H=64, N=4, K=2, M=2)
    out = prefill_mosaic.paged_prefill_attention(
        q[:, :0], k, v, t, s, pos[:, :0], scale=0.1, interpret=True
    )
    assert out.shape == (2, 0, 4, 64) and out.dtype == q.dtype
    with pytest.raises(ValueError, match="seq_lens must be"):
        prefill_mosaic.paged_prefill_attention(
            q[:, :0], k, v, t, s[:1], pos[:, :0], scale=0.1, interpret=True
        )


def _bad(**over):
    """Zero inputs (bf16, H=64, page 16, N=4, K=2) with ``over`` replacing some of them."""
    B, T, N, K, H, page = 2, 4, over.pop("N", 4), 2, over.pop("H", 64), over.pop("page", 16)
    dt = over.pop("dtype", jnp.bfloat16)
    args = dict(
        q=jnp.zeros((B, T, N, H), jnp.bfloat16),
        k_pool=jnp.zeros((2, 8, K, page, H), dt),
        v_pool=jnp.zeros((2, 8, K, page, H), dt),
        block_tables=jnp.zeros((B, 3), jnp.int32),
        seq_lens=jnp.zeros((B,), jnp.int32),
        q_positions=jnp.zeros((B, T), jnp.int32),
    )
    args.update({k: over.pop(k) for k in list(over) if k in args})
    return args, over


@pytest.mark.parametrize(
    "over, match",
    [
        (dict(q=jnp.zeros((2, 8, 64), jnp.bfloat16)), r"q must be \[B, T, N, H\]"),
        (dict(q_positions=jnp.zeros((2, 3), jnp.int32)), r"q_positions must be i32\[B=2, T=4\]"),
        (dict(q_positions=jnp.zeros((2, 4), jnp.float32)), r"got float32\[2, 4\]"),
        (dict(k_scale=jnp.ones((2, 2))), r"k_scale/v_scale given.*allowed: None"),
        (dict(dtype=jnp.float8_e4m3fn), r"k_pool dtype float8_e4m3fn not supported; allowed"),
        (dict(dtype=jnp.float32), "float32 only in interpret mode"),
        (dict(H=96), "head dim H=96 must be a multiple of 64"),
        (dict(page=12), "page_size=12 must be a multiple of 8"),
        (dict(N=3), "N=3 must be a multiple of num KV heads K=2"),
        (dict(N=130), r"GQA group N/K=65 must be <= 64"),
        (dict(block_kv=48), "block_kv=48 must be a positive multiple of 64"),
        (dict(num_stages=0), r"num_stages=0 must be in 1\.\.8"),
        (dict(layer=2), "layer=2 is outside the pools' L=2 layers"),
        (dict(sliding_window=0), "sliding_window=0 must be None or >= 1"),
        (dict(soft_cap=-1.0), "soft_cap=-1.0 must be None or > 0"),
    ],
)
def test_bad_arguments_raise(over, match):
    args, kw = _bad(**over)
    with pytest.raises(ValueError, match=match):
        prefill_mosaic.paged_prefill_attention(**args, scale=0.1, **kw)


@pytest.mark.parametrize(
    "T, G, tq", [(16, 4, 16), (16, 8, 8), (16, 1, 16), (100, 1, 64), (5, 3, 5)]
)
def test_tile_tokens(T, G, tq):
    assert prefill_mosaic.tile_tokens(T, G) == tq
