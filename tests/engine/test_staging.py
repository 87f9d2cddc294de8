"""The step's staging buffer (jaxinfer.step.stage_inputs): same tokens and KV writes as without
it, updated in place under donation, and a clear error when a step does not fit."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.attention import make_attention_fn
from jaxinfer.config import EngineConfig, ModelConfig
from jaxinfer.engine.batch_builder import BucketSpec, build_host_batch
from jaxinfer.engine.block_manager import BlockManager
from jaxinfer.engine.llm_engine import LLMEngine
from jaxinfer.engine.scheduler import Scheduler
from jaxinfer.engine.sequence import Sequence
from jaxinfer.kv_cache import init_kv_cache
from jaxinfer.models import registry
from jaxinfer.sampling_params import SamplingParams
from jaxinfer.step import make_step_fn, staging_size

CFG = ModelConfig("qwen3", 256, 64, 96, 2, 4, 2, 16)
PAGE = 4


def _batches():
    """A packed prefill batch of three prompts, then the decode batch that follows it."""
    bm = BlockManager(64, PAGE)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64,
                      page_size=PAGE)
    for i, n in enumerate([5, 13, 9]):
        sched.add(Sequence(request_id=str(i), prompt_token_ids=[(3 * i + j) % 250 + 1
                                                                for j in range(n)],
                           params=SamplingParams(temperature=0.0, max_tokens=4), seed=i))
    buckets = BucketSpec.build(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64,
                               page_size=PAGE)
    prefill = sched.schedule()
    hb_prefill = build_host_batch(prefill, page_size=PAGE, buckets=buckets)
    sched.postprocess(prefill, [7, 8, 9])
    decode = sched.schedule()
    return [hb_prefill, build_host_batch(decode, page_size=PAGE, buckets=buckets)]


def _run(hbs, staged: bool):
    params = registry.init_params(CFG, jax.random.key(0), jnp.float32)
    step = make_step_fn(CFG, make_attention_fn("reference"), True)
    size = staging_size([hb.shape_key for hb in hbs]) if staged else 0
    kv = init_kv_cache(CFG, 64, PAGE, jnp.float32, staging_size=size)
    outs = []
    for hb in hbs:
        eng_inputs = LLMEngine._device_inputs.__get__(_Shim(kv))(hb)
        staging_in = eng_inputs[0].staging
        tokens, kv = step(params, *eng_inputs)
        if staged:
            assert staging_in.is_deleted()  # donated: the buffer is updated in place
            assert kv.staging.shape == (size,)
        outs.append(np.asarray(tokens))
    return outs, np.asarray(kv.k), np.asarray(kv.v)


class _Shim:
    """Just enough of an LLMEngine for `LLMEngine._device_inputs`."""

    def __init__(self, kv):
        self.kv = kv
        self._no_prev_tokens = jnp.zeros((4,), jnp.int32)


def test_staged_step_matches_unstaged():
    hbs = _batches()
    assert hbs[0].packed and not hbs[1].packed
    plain, k0, v0 = _run(hbs, staged=False)
    staged, k1, v1 = _run(hbs, staged=True)
    for a, b in zip(plain, staged):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(k0, k1)
    np.testing.assert_array_equal(v0, v1)
    assert np.abs(k1).sum() > 0  # the steps did write K/V


def test_staging_too_small_is_a_clear_error():
    hb = _batches()[1]
    params = registry.init_params(CFG, jax.random.key(0), jnp.float32)
    step = make_step_fn(CFG, make_attention_fn("reference"), True)
    kv = init_kv_cache(CFG, 64, PAGE, jnp.float32, staging_size=3)
    args = LLMEngine._device_inputs.__get__(_Shim(kv))(hb)
    with pytest.raises(ValueError, match="staging entries"):
        step(params, *args)


def test_engine_staging_covers_its_largest_steps():
    params = registry.init_params(CFG, jax.random.key(0), jnp.float32)
    eng = LLMEngine(CFG, params, EngineConfig(max_model_len=64, num_pages=64, page_size=PAGE,
                                              max_num_seqs=4, max_num_batched_tokens=64))
    b = eng.buckets
    need = staging_size([((b.batch[-1], 1), (b.batch[-1], b.pages[-1])),
                         ((1, b.packed_tokens[-1]), (b.batch[-1], b.pages[-1]))])
    assert eng.kv.staging.shape == (need,) and need == 4 * 16 + 4 + 2 * 64
