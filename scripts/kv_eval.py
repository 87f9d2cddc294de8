"""The measuring side of eval_accuracy.py: a sequence teacher-forced through the paged KV cache
in chunks (`teacher_forced`: its mean next-token NLL), the first chunk's K/V, means and
calibrated scales, fp8 KV reads simulated on float32 pools (`simulated_attention`), the fp8
rounding noise of fp8 KV (`jittered`), and greedy decoding through the engine (`greedy`) with
its `agreement` against the baseline's."""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer import LLM, SamplingParams, models
from jaxinfer.models.kernels import ModelKernels
from jaxinfer.models.kv_cache import init_kv_cache
from pallas_kernels.kv_quant import FP8, FP8_MAX, quantize
from pallas_kernels.paged_attention import reference

PAGE_SIZE = 16


def fp8_read(x: jax.Array, scale: jax.Array, mean: jax.Array) -> jax.Array:
    """Pages x f32[P, K, page_size, H] as fp8 pages holding ``x - mean`` (mean f32[K, H]) give
    them back, mean added: the cache write's `quantize` by ``scale`` f32[K], then times it."""
    s = scale[:, None, None]
    return quantize(x - mean[:, None], s, FP8).astype(jnp.float32) * s + mean[:, None]


def simulated_attention(chunk_exact: bool, k_scale, v_scale, k_mean, v_mean):
    """`reference.paged_attention` (one row) over float32 pools, each layer's pages read through
    `fp8_read` (scales f32[L, K], means f32[L, K, H]); ``chunk_exact``: pages at or after the
    first query position (the current chunk's, page-aligned) exact."""

    def attn(q, k_pool, v_pool, block_tables, seq_lens, q_positions, *, layer, scale, **_):
        M, ps = block_tables.shape[1], k_pool.shape[3]
        start = jnp.min(q_positions) if chunk_exact else jnp.iinfo(jnp.int32).max
        page_pos = (
            jnp.full(k_pool.shape[1], -1, jnp.int32)
            .at[block_tables[0]]
            .set(jnp.arange(M, dtype=jnp.int32) * ps)
        )  # first position of each page
        exact = (page_pos >= start)[:, None, None, None]
        k, v = (
            jnp.where(exact, p[layer], fp8_read(p[layer], s[layer], m[layer]))[None]
            for p, s, m in ((k_pool, k_scale, k_mean), (v_pool, v_scale, v_mean))
        )
        return reference.paged_attention(
            q, k, v, block_tables, seq_lens, q_positions, layer=0, scale=scale
        )

    return attn


@functools.partial(jax.jit, static_argnames=("cfg", "kernels"), donate_argnames=("kv",))
def _chunk(params, cfg, kv, tokens, positions, targets, weights, kernels=ModelKernels()):
    """Forward one chunk [1, T] at ``positions`` (slot = page 1 onwards, contiguous) -> (sum of
    the weighted next-token NLL, cache)."""
    hidden, kv = models.forward(
        params, cfg, tokens, positions, positions + PAGE_SIZE, kv, kernels=kernels
    )
    logp = jax.nn.log_softmax(models.compute_logits(params, cfg, hidden), axis=-1)
    nll = -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    return jnp.sum(nll * weights), kv


def teacher_forced(
    params,
    cfg,
    ids: np.ndarray,
    chunk: int,
    kv_dtype,
    kv_set=None,
    chunks: int | None = None,
    kernels=ModelKernels(),
):
    """(mean next-token NLL over ``ids[1:]``, final cache) of ``ids`` as one sequence in chunks
    of ``chunk`` tokens (pages 1.. in order); ``kv_set``: `KVCache` fields to set (scales,
    means); ``chunks``: stop after that many; ``kernels``: the model's (`simulated_attention`)."""
    n = len(ids)
    M = n // PAGE_SIZE
    kv = init_kv_cache(cfg, M + 1, PAGE_SIZE, kv_dtype)
    kv = kv.replace(block_tables=jnp.arange(1, M + 1, dtype=jnp.int32)[None])
    kv = kv.replace(**{k: jnp.array(x) for k, x in (kv_set or {}).items()})  # copies: donated
    targets = np.append(ids[1:], 0).astype(np.int32)
    weights = np.append(np.ones(n - 1, np.float32), 0.0)
    total = 0.0
    for c in range(n // chunk if chunks is None else chunks):
        sl = slice(c * chunk, (c + 1) * chunk)
        kv = kv.replace(seq_lens=jnp.asarray([sl.stop], jnp.int32))
        pos = np.arange(sl.start, sl.stop, dtype=np.int32)[None]
        nll, kv = _chunk(
            params,
            cfg,
            kv,
            jnp.asarray(ids[sl][None]),
            jnp.asarray(pos),
            jnp.asarray(targets[sl][None]),
            jnp.asarray(weights[sl][None]),
            kernels,
        )
        total += float(nll)
    return total / (n - 1), kv


def first_chunk_kv(params, cfg, ids: np.ndarray, chunk: int):
    """The float32 K and V [L, chunk / page_size, K, page_size, H] of the first chunk of ids."""
    _, kv = teacher_forced(params, cfg, ids, chunk, jnp.float32, chunks=1)
    return tuple(p[:, 1 : 1 + chunk // PAGE_SIZE] for p in (kv.k, kv.v))


def first_chunk_means(kv, k: bool = True, v: bool = True):
    """k_mean, v_mean f32[L, K, H] of `first_chunk_kv`'s K and V (zeros where ``k``, ``v`` off)."""
    return tuple(
        jnp.mean(p, axis=(1, 3)) if on else jnp.zeros_like(p[:, 0, :, 0])
        for p, on in zip(kv, (k, v))
    )


def calibrated_scales(kv, margin: float, means=None):
    """k_scale, v_scale f32[L, K]: ``amax x margin / 448`` of `first_chunk_kv`'s K and V less
    ``means`` (f32[L, K, H] each; None: 0) per layer and KV head."""
    means = means or tuple(jnp.zeros_like(p[:, 0, :, 0]) for p in kv)
    return tuple(
        jnp.maximum(jnp.max(jnp.abs(p - m[:, None, :, None]), axis=(1, 3, 4)), 1e-6)
        * margin
        / FP8_MAX
        for p, m in zip(kv, means)
    )


def greedy(
    params,
    cfg,
    prompts,
    gen_tokens: int,
    kv_cache_dtype: str,
    kv_set=None,
    quantization=None,
    fp8_gemm: str = "w8a16",
):
    """Greedy token ids of each prompt (EOS ignored) through the engine, float32 compute
    (``quantization`` "fp8": weights quantised by `LLM.from_params`, ``fp8_gemm`` their GEMM)."""
    llm = LLM.from_params(
        cfg,
        params,
        dtype="float32",
        kv_cache_dtype=kv_cache_dtype,
        quantization=quantization,
        kernels=f"fp8_gemm={fp8_gemm}",
        max_model_len=max(map(len, prompts)) + gen_tokens,
        max_num_seqs=len(prompts),
        page_size=PAGE_SIZE,
    )
    runner = llm.engine.runner
    runner.kv = runner.kv.replace(**{k: jnp.array(x) for k, x in (kv_set or {}).items()})
    sp = SamplingParams(temperature=0.0, max_tokens=gen_tokens, ignore_eos=True)
    return [list(o.token_ids) for o in llm.generate(prompts, sp)]


def agreement(ref: list[list[int]], out: list[list[int]]) -> float:
    """Mean over prompts of (positions equal before the first divergence) / len(ref)."""
    fr = []
    for a, b in zip(ref, out):
        same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        fr.append(same / len(a))
    return float(np.mean(fr))


def jittered(params, cfg, ids, args, setting, seed: int) -> dict:
    """The perplexity row of the engine's fp8 KV ``setting`` (as in `main`) with 1e-3 x N(0, 1)
    (``seed``) added to its means (zeros if none): no change to the method, but other values
    round differently, so the spread of such rows is the noise of fp8 rounding."""
    kv_cache_dtype, kv_dtype, kv_set, _, _ = setting
    L, K, H = cfg.num_layers, cfg.num_kv_heads, cfg.head_dim
    noise = np.random.default_rng(seed).standard_normal((2, L, K, H)).astype(np.float32) * 1e-3
    jit = {k: kv_set.get(k, 0.0) + n for k, n in zip(("k_mean", "v_mean"), noise)}
    t = time.perf_counter()
    nll, _ = teacher_forced(params, cfg, ids, args.chunk, kv_dtype, {**kv_set, **jit})
    return dict(
        kv_cache_dtype=kv_cache_dtype,
        quantization=None,
        fp8_gemm=None,
        kv_scales=args.kv_scales,
        kv_method=(
            "engine" + (f"+smooth ({args.kv_smooth})" if args.kv_smooth else "") + f" jitter {seed}"
        ),
        ppl=float(np.exp(nll)),
        gen=None,
        seconds=time.perf_counter() - t,
    )
