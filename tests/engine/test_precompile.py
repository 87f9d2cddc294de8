"""Ahead-of-time compiles: the host dry run lists exactly the step shapes generate() visits, and
after LLM.precompile generate() compiles nothing and returns the same tokens."""

import jax
import pytest
from tiny_model import TINY

from jaxinfer import LLM, SamplingParams
from jaxinfer.config import KernelConfig, ModelConfig
from jaxinfer.step_input import ShapeKey

# small budgets so the workload has chunked prefill, several batch buckets and preemption-free
# page growth across page-table buckets
ENGINE = dict(
    max_model_len=96, num_pages=64, page_size=4, max_num_seqs=3, max_num_batched_tokens=32
)


@pytest.fixture(scope="module")
def weights(tiny_params):
    return tiny_params


def _llm(params, kernels=KernelConfig(), **kw):
    return LLM.from_params(ModelConfig(**TINY), params, kernels=kernels, **dict(ENGINE, **kw))


def _workload():
    lens = [5, 40, 9, 17, 3, 26]
    prompts = [
        {"prompt_token_ids": [(7 * i + j) % 250 + 1 for j in range(n)]} for i, n in enumerate(lens)
    ]
    params = [
        SamplingParams(temperature=0.0, max_tokens=6),
        SamplingParams(temperature=0.8, seed=3, max_tokens=11, n=2),
        SamplingParams(temperature=0.0, max_tokens=2, logprobs=2),
        SamplingParams(temperature=0.0, max_tokens=9, repetition_penalty=1.3),
        SamplingParams(temperature=0.7, top_k=5, seed=1, max_tokens=4),
        SamplingParams(temperature=0.0, max_tokens=14, min_tokens=14, stop_token_ids=[5]),
    ]
    return prompts, params


@pytest.mark.parametrize("async_scheduling, num_pages", [(True, 64), (False, 64), (True, 16)])
def test_plan_shapes_are_the_shapes_generate_visits(weights, async_scheduling, num_pages):
    llm = _llm(weights, async_scheduling=async_scheduling, num_pages=num_pages)
    prompts, params = _workload()
    planned = llm.engine.plan_shapes(
        [(p["prompt_token_ids"], sp) for p, sp in zip(prompts, params)]
    )
    assert len(planned) == len(set(planned)) >= 4
    assert all(isinstance(k, ShapeKey) for k in planned)
    assert any(k.packed for k in planned) and any(not k.packed for k in planned)
    out = llm.generate(prompts, params)
    preempted = sum(o.metrics.num_preemptions for o in out)
    assert (preempted > 0) == (num_pages == 16)  # the small pool preempts: the dry run must too
    assert llm.engine.stats().compiled_shapes == set(planned)
    assert llm.engine.stats().num_lazy_compiles == len(planned)


# a batch bucket no other test uses
KC5 = KernelConfig(batch_buckets=(5,))


@pytest.fixture(scope="module")
def expected5(weights):
    """`_workload`'s token ids on a synchronous engine (it never merges pending tokens)."""
    prompts, params = _workload()
    return [
        o.token_ids for o in _llm(weights, KC5, async_scheduling=False).generate(prompts, params)
    ]


def test_precompile_then_generate_compiles_nothing_and_matches(weights, expected5):
    w, expected = weights, expected5
    prompts, params = _workload()
    kc = KC5
    llm = _llm(w, kc)
    info = llm.precompile(prompts, params, max_workers=2)
    assert info["shapes"] == info["planned"] == llm.engine.stats().num_compiles >= 4
    assert llm.precompile(prompts, params)["shapes"] == 0  # already compiled: nothing to do
    compiles, jit_calls = [], []
    ex = llm.engine.runner.executor
    ex.steps = {
        g: (lambda *a, _f=f, **k: jit_calls.append(1) or _f(*a, **k)) for g, f in ex.steps.items()
    }

    def listener(name, secs, **kw):
        if name == "/jax/core/compile/backend_compile_duration":
            compiles.append(secs)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        out = llm.generate(prompts, params)
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert [o.token_ids for o in out] == expected
    assert llm.engine.stats().num_lazy_compiles == 0
    # nothing at all is compiled while generating (not even a helper of the engine loop: the
    # pending-token merge of asynchronous scheduling used to compile once per batch-size pair)
    assert compiles == []
    # the jit entry points were never called: every step ran an ahead-of-time executable
    assert jit_calls == []


def test_background_compile_never_stalls_and_matches(weights, expected5):
    """As vLLM never compiles inside a running step (its CUDA graphs are captured at start), a
    step shape not compiled yet runs padded to a compiled shape that covers it (more rows, pages,
    tokens; sampling for all-greedy) while its own compiles in a thread, used once done."""
    prompts, params = _workload()
    llm = _llm(weights, KC5, compile_in_background=True)
    planned = llm.engine.plan_shapes(
        [(p["prompt_token_ids"], sp) for p, sp in zip(prompts, params)]
    )
    b = llm.engine.runner.buckets
    covering = {
        k._replace(pages=b.pages[-1], all_greedy=False)
        if not k.packed
        else k._replace(
            pages=b.pages[-1],
            all_greedy=False,
            tokens=b.packed_tokens[-1],
            query=b.prefill_tokens[-1],
        )
        for k in planned
    }
    assert len(covering) < len(set(planned))
    llm.engine.precompile(sorted(covering, key=str))
    assert [o.token_ids for o in llm.generate(prompts, params)] == expected5
    stats, ex = llm.engine.stats(), llm.engine.runner.executor
    assert stats.num_lazy_compiles == 0 and stats.num_covered_steps > 0
    assert ex.pending and set(ex.pending) <= set(planned) - covering
    for f in list(ex.pending.values()):
        f.result()
    assert all(llm.engine.runner.runnable(k) == k for k in planned)  # now their own shapes


def test_precompile_rejects_a_bad_request_by_index(weights):
    llm = _llm(weights)
    with pytest.raises(ValueError, match="request 1: .*max_model_len"):
        llm.precompile([[1, 2, 3], [4] * 90], SamplingParams(max_tokens=20))
    assert llm.engine.stats().num_compiles == 0


def test_warm_runs_write_only_the_null_page(weights):
    import numpy as np

    llm = _llm(weights)
    prompts, params = _workload()
    llm.generate(prompts[:2], params[:2])  # fills some pages
    k0, v0 = np.asarray(llm.engine.runner.kv.k), np.asarray(llm.engine.runner.kv.v)
    assert np.abs(k0[:, 1:]).sum() > 0  # pages beyond the null page hold KV
    info = llm.precompile(prompts[2:], params[2:])
    assert info["shapes"] >= 1 and info["warm_s"] > 0
    k1, v1 = np.asarray(llm.engine.runner.kv.k), np.asarray(llm.engine.runner.kv.v)
    np.testing.assert_array_equal(k1[:, 1:], k0[:, 1:])
    np.testing.assert_array_equal(v1[:, 1:], v0[:, 1:])


def _steps(w, **kernels):
    ex = _llm(w, KernelConfig(**kernels)).engine.runner.executor
    return ex.step_fn, ex.steps


def decode(B):
    return ShapeKey(batch=B, tokens=1, pages=8, penalty=0, query=None, all_greedy=True)


PACKED = ShapeKey(batch=3, tokens=32, pages=8, penalty=0, query=16, all_greedy=False)


def test_cublas_decode_steps_from_the_configured_batch(weights):
    step_fn, steps = _steps(weights, cublas_decode_min_batch=2)
    assert step_fn(decode(1)) is steps["xla"]
    assert step_fn(decode(2)) is steps["cublas"]
    assert step_fn(PACKED) is steps["xla"]  # prefill keeps XLA's choice
    step_fn, steps = _steps(weights, cublas_decode_min_batch=None)
    assert step_fn(decode(3)) is steps["xla"]
    with pytest.raises(ValueError, match="cublas_decode_min_batch"):
        KernelConfig(cublas_decode_min_batch=0)


def test_prefill_gemm_picks_the_prefill_steps_back_end(weights):
    step_fn, steps = _steps(weights, prefill_gemm="cublas", cublas_decode_min_batch=None)
    assert step_fn(PACKED) is steps["cublas"]
    assert step_fn(decode(4)) is steps["xla"]
    with pytest.raises(ValueError, match="prefill_gemm.*allowed: 'xla', 'cublas'"):
        KernelConfig(prefill_gemm="cutlass")
