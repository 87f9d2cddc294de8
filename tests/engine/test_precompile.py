"""Ahead-of-time compiles: the host dry run lists exactly the step shapes generate() visits, and
after LLM.precompile generate() compiles nothing and returns the same tokens."""

import jax
import jax.numpy as jnp
import pytest

from jaxinfer import LLM, SamplingParams
from jaxinfer.config import ModelConfig
from jaxinfer.models import registry

CFG = ModelConfig("qwen3", 256, 64, 96, 2, 4, 2, 16)
# small budgets so the workload has chunked prefill, several batch buckets and preemption-free
# page growth across page-table buckets
ENGINE = dict(max_model_len=96, num_pages=64, page_size=4, max_num_seqs=3,
              max_num_batched_tokens=32)


def _llm(**kw):
    params = registry.init_params(CFG, jax.random.key(0), jnp.float32)
    return LLM.from_params(CFG, params, **dict(ENGINE, **kw))


def _workload():
    lens = [5, 40, 9, 17, 3, 26]
    prompts = [{"prompt_token_ids": [(7 * i + j) % 250 + 1 for j in range(n)]}
               for i, n in enumerate(lens)]
    params = [SamplingParams(temperature=0.0, max_tokens=6),
              SamplingParams(temperature=0.8, seed=3, max_tokens=11),
              SamplingParams(temperature=0.0, max_tokens=2),
              SamplingParams(temperature=0.0, max_tokens=9, repetition_penalty=1.3),
              SamplingParams(temperature=0.7, top_k=5, seed=1, max_tokens=4),
              SamplingParams(temperature=0.0, max_tokens=14)]
    return prompts, params


@pytest.mark.parametrize("async_scheduling, num_pages", [(True, 64), (False, 64), (True, 16)])
def test_plan_shapes_are_the_shapes_generate_visits(async_scheduling, num_pages):
    llm = _llm(async_scheduling=async_scheduling, num_pages=num_pages)
    prompts, params = _workload()
    planned = llm.engine.plan_shapes([(p["prompt_token_ids"], sp) for p, sp in zip(prompts, params)])
    assert len(planned) == len(set(planned)) >= 4
    assert any(k[3] is not None for k in planned) and any(k[3] is None for k in planned)
    out = llm.generate(prompts, params)
    preempted = sum(o.metrics.num_preemptions for o in out)
    assert (preempted > 0) == (num_pages == 16)  # the small pool preempts: the dry run must too
    assert llm.engine.compiled_shapes == set(planned)
    assert llm.engine.num_lazy_compiles == len(planned)


def test_precompile_then_generate_compiles_nothing_and_matches():
    prompts, params = _workload()
    # a batch bucket no other test uses, so no jit cache of the process is warm for these shapes
    # (the reference run is synchronous: it never merges pending tokens)
    expected = [o.token_ids for o in _llm(batch_buckets=(5,), async_scheduling=False)
                .generate(prompts, params)]

    llm = _llm(batch_buckets=(5,))
    info = llm.precompile(prompts, params, max_workers=2)
    assert info["shapes"] == info["planned"] == llm.engine.num_compiles >= 4
    assert llm.precompile(prompts, params)["shapes"] == 0  # already compiled: nothing to do
    compiles = []

    def listener(name, secs, **kw):
        if name == "/jax/core/compile/backend_compile_duration":
            compiles.append(secs)
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        out = llm.generate(prompts, params)
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert [o.token_ids for o in out] == expected
    assert llm.engine.num_lazy_compiles == 0
    # nothing at all is compiled while generating (not even a helper of the engine loop: the
    # pending-token merge of asynchronous scheduling used to compile once per batch-size pair)
    assert compiles == []
    # the jit entry points were never traced: every step ran an ahead-of-time executable
    assert all(f._cache_size() == 0 for f in llm.engine._steps.values())


def test_precompile_rejects_a_bad_request_by_index():
    llm = _llm()
    with pytest.raises(ValueError, match="request 1: .*max_model_len"):
        llm.precompile([[1, 2, 3], [4] * 90], SamplingParams(max_tokens=20))
    assert llm.engine.num_compiles == 0


def test_warm_runs_write_only_the_null_page():
    import numpy as np
    llm = _llm()
    prompts, params = _workload()
    llm.generate(prompts[:2], params[:2])  # fills some pages
    k0, v0 = np.asarray(llm.engine.kv.k), np.asarray(llm.engine.kv.v)
    assert np.abs(k0[:, 1:]).sum() > 0  # pages beyond the null page hold KV
    info = llm.precompile(prompts[2:], params[2:])
    assert info["shapes"] >= 1 and info["warm_s"] > 0
    k1, v1 = np.asarray(llm.engine.kv.k), np.asarray(llm.engine.kv.v)
    np.testing.assert_array_equal(k1[:, 1:], k0[:, 1:])
    np.testing.assert_array_equal(v1[:, 1:], v0[:, 1:])


def test_cublas_decode_steps_from_the_configured_batch():
    eng = _llm(cublas_decode_min_batch=2).engine
    decode = lambda B: ((B, 1), (B, 8), 0, None, True)  # noqa: E731
    packed = ((1, 32), (3, 8), 0, (3, 16), False)
    assert eng.step_fn(decode(1)) is eng._steps[(True, "xla")]
    assert eng.step_fn(decode(2)) is eng._steps[(True, "cublas")]
    assert eng.step_fn(packed) is eng._steps[(False, "xla")]  # prefill keeps XLA's choice
    off = _llm(cublas_decode_min_batch=None).engine
    assert off.step_fn(decode(3)) is off._steps[(True, "xla")]
    with pytest.raises(ValueError, match="cublas_decode_min_batch"):
        _llm(cublas_decode_min_batch=0)


def test_prefill_gemm_picks_the_prefill_steps_back_end():
    eng = _llm(prefill_gemm="cublas", cublas_decode_min_batch=None).engine
    packed = ((1, 32), (3, 8), 0, (3, 16), False)
    assert eng.step_fn(packed) is eng._steps[(False, "cublas")]
    assert eng.step_fn(((4, 1), (4, 8), 0, None, True)) is eng._steps[(True, "xla")]
    with pytest.raises(ValueError, match="prefill_gemm.*allowed: 'xla', 'cublas'"):
        _llm(prefill_gemm="cutlass")


def test_qkv_prologue_option_is_checked():
    with pytest.raises(ValueError, match="qkv_prologue.*allowed: 'auto', 'xla', 'triton'"):
        _llm(qkv_prologue="cuda")
    if jax.default_backend() != "gpu":
        with pytest.raises(ValueError, match="GPU kernel"):
            _llm(qkv_prologue="triton")


def test_add_rms_norm_option_is_checked():
    with pytest.raises(ValueError, match="add_rms_norm.*allowed: 'auto', 'xla', 'triton'"):
        _llm(add_rms_norm="cuda")
    if jax.default_backend() != "gpu":
        with pytest.raises(ValueError, match="GPU kernel"):
            _llm(add_rms_norm="triton")


def test_fused_kernels_auto_resolution():
    from jaxinfer.config import EngineConfig, ModelConfig
    from jaxinfer.engine.llm_engine import resolve_fused_kernels

    def cfg(D, H):
        return ModelConfig(architecture="qwen3", vocab_size=64, hidden_size=D,
                           intermediate_size=2 * D, num_layers=1, num_heads=2, num_kv_heads=1,
                           head_dim=H, max_position_embeddings=64)

    auto = EngineConfig(qkv_prologue="auto", add_rms_norm="auto")
    assert resolve_fused_kernels(cfg(4096, 128), auto, "gpu", "bfloat16") == ("triton", "triton")
    assert resolve_fused_kernels(cfg(4096, 128), auto, "cpu", "bfloat16") == ("xla", "xla")
    assert resolve_fused_kernels(cfg(4096, 128), auto, "gpu", "float32") == ("xla", "xla")
    # SmolLM2: D=576 is no power of 2, H=64 is fine
    assert resolve_fused_kernels(cfg(576, 64), auto, "gpu", "bfloat16") == ("triton", "xla")
    with pytest.raises(ValueError, match="add_rms_norm='triton' needs a power-of-2 hidden size"):
        resolve_fused_kernels(cfg(576, 64), EngineConfig(add_rms_norm="triton"), "gpu", "bfloat16")
    with pytest.raises(ValueError, match="qkv_prologue='triton' needs head dim"):
        resolve_fused_kernels(cfg(512, 96), EngineConfig(qkv_prologue="triton"), "gpu", "bfloat16")
