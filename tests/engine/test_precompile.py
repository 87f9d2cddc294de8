"""Ahead-of-time compiles: the host dry run lists exactly the step shapes generate() visits;
after LLM.precompile generate() compiles nothing and returns the same tokens; after
LLM.precompile() (the whole planned set) no request of any sampling feature compiles a forward
or a planned sampler."""

import jax
import pytest
from tiny_model import TINY

from jaxinfer import LLM, SamplingParams, StructuredOutputsParams
from jaxinfer.config import KernelConfig, ModelConfig
from jaxinfer.runner import executor
from jaxinfer.step_input import ForwardKey, StepShape

# small budgets so the workload has chunked prefill, mixed steps, several row buckets
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
        SamplingParams(temperature=0.0, max_tokens=2, logprobs=2, prompt_logprobs=1),
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
    assert all(isinstance(k, StepShape) for k in planned)
    assert {k.forward.decode for k in planned} == {True, False}
    out = llm.generate(prompts, params)
    preempted = sum(o.metrics.num_preemptions for o in out)
    assert (preempted > 0) == (num_pages == 16)  # the small pool preempts: the dry run must too
    stats = llm.engine.stats()
    assert stats.forward_shapes == {k.forward for k in planned}
    assert stats.sampler_shapes == {k.sampler for k in planned}
    assert stats.prompt_shapes == {(k.forward.tokens, k.prompt) for k in planned if k.prompt}
    assert stats.num_lazy_compiles == stats.num_compiles


# a batch bucket no other test uses
KC5 = KernelConfig(batch_buckets=(5,))


@pytest.fixture(scope="module")
def expected5(weights):
    """`_workload`'s token ids on a synchronous engine (it never merges pending tokens)."""
    prompts, params = _workload()
    return [
        o.token_ids for o in _llm(weights, KC5, async_scheduling=False).generate(prompts, params)
    ]


def test_precompile_then_generate_compiles_nothing_and_matches(weights, expected5, monkeypatch):
    prompts, params = _workload()
    llm = _llm(weights, KC5)
    info = llm.precompile(prompts, params, max_workers=2)
    assert info["shapes"] == llm.engine.stats().num_compiles >= 4
    assert llm.precompile(prompts, params)["shapes"] == 0  # already compiled: nothing to do
    compiles, jit_calls = [], []
    spy = lambda f: lambda *a, **k: jit_calls.append(1) or f(*a, **k)  # noqa: E731
    monkeypatch.setattr(executor, "SAMPLE_STEP", spy(executor.SAMPLE_STEP))
    monkeypatch.setattr(executor, "PROMPT_STEP", spy(executor.PROMPT_STEP))
    monkeypatch.setattr(
        executor, "FORWARD_STEPS", {g: spy(f) for g, f in executor.FORWARD_STEPS.items()}
    )

    def listener(name, secs, **kw):
        if name == "/jax/core/compile/backend_compile_duration":
            compiles.append(secs)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        out = llm.generate(prompts, params)
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert [o.token_ids for o in out] == expected5
    assert llm.engine.stats().num_lazy_compiles == 0
    # nothing at all is compiled while generating (not even a helper of the engine loop)
    assert compiles == []
    assert jit_calls == []  # every program ran an ahead-of-time executable


def test_planned_set_covers_every_sampling_feature(tiny_llm):
    """After `LLM.precompile()`, requests using every sampling feature at several batch sizes
    compile no forward and no sampler (prompt scorers compile on first use)."""
    llm = tiny_llm(max_compiles=None, max_num_seqs=4, max_num_batched_tokens=64)
    llm.precompile()
    stats = llm.engine.stats()
    forwards, samplers = set(stats.forward_shapes), set(stats.sampler_shapes)
    planned = llm.engine.runner.buckets.planned()
    assert forwards == set(planned["forward"]) and samplers == set(planned["sampler"])
    ids = llm.get_tokenizer().encode
    features = [
        dict(logprobs=3),
        dict(prompt_logprobs=2),
        dict(repetition_penalty=1.2, presence_penalty=0.5, frequency_penalty=0.3),
        dict(logit_bias={5: 3.0, 9: -100.0}),
        dict(min_tokens=6),
        dict(structured_outputs=StructuredOutputsParams(choice=["yes", "no"])),
        dict(n=3, temperature=0.9, top_p=0.8, seed=2),
        dict(temperature=0.0),
    ]
    for batch in (1, 3, 8):
        prompts = [ids(f"prompt {i} " * (1 + 7 * i % 13)) for i in range(batch)]
        for f in features:
            sp = SamplingParams(max_tokens=6, **dict(dict(temperature=0.7, seed=1), **f))
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp)
            assert all(len(c.token_ids) >= 1 for o in outs for c in o.outputs)
    stats = llm.engine.stats()
    assert stats.forward_shapes == forwards
    assert stats.sampler_shapes == samplers


def test_precompile_rejects_a_bad_request_by_index(weights):
    llm = _llm(weights)
    with pytest.raises(ValueError, match="request 1: .*max_model_len"):
        llm.precompile([[1, 2, 3], [4] * 96], SamplingParams(max_tokens=20))
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


def _gemm(w, **kernels):
    return _llm(w, KernelConfig(**kernels)).engine.runner.executor.gemm


def test_cublas_decode_steps_from_the_configured_batch(weights):
    gemm = _gemm(weights, cublas_decode_min_batch=2)
    assert gemm(ForwardKey(1, True)) == "xla"
    assert gemm(ForwardKey(2, True)) == "cublas"
    assert gemm(ForwardKey(32, False)) == "xla"  # ragged steps keep prefill_gemm's choice
    assert _gemm(weights, cublas_decode_min_batch=None)(ForwardKey(3, True)) == "xla"
    with pytest.raises(ValueError, match="cublas_decode_min_batch"):
        KernelConfig(cublas_decode_min_batch=0)


def test_prefill_gemm_picks_the_ragged_steps_back_end(weights):
    gemm = _gemm(weights, prefill_gemm="cublas", cublas_decode_min_batch=None)
    assert gemm(ForwardKey(32, False)) == "cublas"
    assert gemm(ForwardKey(4, True)) == "xla"
    with pytest.raises(ValueError, match="prefill_gemm.*allowed: 'xla', 'cublas'"):
        KernelConfig(prefill_gemm="cutlass")
