"""`LLM.generate` input checking on a tiny random model (`LLM.from_params`, no tokenizer): malformed
token-id prompts are rejected with a clear per-request error, never converted, and never take
down the other requests of the call."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer import LLM, SamplingParams, TokensPrompt

GREEDY = SamplingParams(temperature=0.0, max_tokens=3)


@pytest.fixture(scope="module")
def llm(tiny_cfg, tiny_params):
    return LLM.from_params(tiny_cfg, tiny_params, max_model_len=64, num_pages=32, max_num_seqs=4)


@pytest.mark.parametrize(
    "bad, needle",
    [
        ({"prompt_token_ids": "12"}, "must be a list of ints; got str"),
        ({"prompt_token_ids": ["1", "2"]}, "holds '1' (str)"),
        ({"prompt_token_ids": None}, "got NoneType"),
        ({"prompt_token_ids": 5}, "got int"),
        ({"prompt_token_ids": [1, True]}, "holds True (bool)"),
        ({"prompt_token_ids": [1, 2.0]}, "holds 2.0 (float)"),
        ({"prompt_token_ids": np.ones((2, 2), np.int32)}, "1-D integer array"),
        ({1: 2}, "[1] are not supported"),
        ({"prompt": "p"}, "has no tokenizer"),
        (
            {"prompt_token_ids": [1], "multi_modal_data": {}},
            "['multi_modal_data'] are not supported",
        ),
        ({"prompt": None}, "'prompt' must be a str"),
        ([1, [2]], "holds [2] (list)"),
        ("text", "has no tokenizer"),
    ],
)
def test_bad_prompt_is_one_error_and_others_run(llm, bad, needle):
    outs = llm.generate([bad, [1, 2, 3]], GREEDY, on_error="return")
    assert outs[0].error is not None and needle in outs[0].error, outs[0].error
    assert outs[0].outputs[0].finish_reason == "error"
    assert outs[1].error is None and len(outs[1].token_ids) == 3
    with pytest.raises(ValueError, match="request 0"):
        llm.generate([bad, [1, 2, 3]], GREEDY)


def test_numpy_token_ids_are_accepted(llm):
    ref = llm.generate([[5, 6, 7]], GREEDY)[0].token_ids
    assert llm.generate([np.array([5, 6, 7])], GREEDY)[0].token_ids == ref
    assert llm.generate([[np.int64(5), np.int32(6), 7]], GREEDY)[0].token_ids == ref
    assert llm.generate({"prompt_token_ids": np.array([5, 6, 7])}, GREEDY)[0].token_ids == ref
    assert llm.generate(TokensPrompt(prompt_token_ids=[5, 6, 7]), GREEDY)[0].token_ids == ref


def test_stop_strings_need_a_tokenizer(llm):
    outs = llm.generate(
        [[1, 2], [3, 4]], [SamplingParams(stop=["a"], max_tokens=2), GREEDY], on_error="return"
    )
    assert "stop_token_ids" in outs[0].error and outs[1].error is None


def test_from_params_and_engine_argument_errors(llm):
    cfg, params = llm.engine.model_config, llm.engine.runner.params
    with pytest.raises(ValueError, match="must be a jaxinfer.config.ModelConfig; got dict"):
        LLM.from_params(cfg.to_dict(), params)
    with pytest.raises(ValueError, match="seed='a' is invalid"):
        LLM.from_params(cfg, params, seed="a")
    with pytest.raises(ValueError, match="a list holding NoneType"):
        llm.generate([[1], [2]], [GREEDY, None])
    with pytest.raises(
        ValueError,
        match=r"unknown engine argument\(s\) \['attention'\]; allowed: "
        r"\[.*'kernels'",
    ):
        LLM.from_params(cfg, params, attention="mosaic")
    with pytest.raises(ValueError, match="kernels: 'attention=mosaic' is invalid"):
        LLM.from_params(cfg, params, kernels="attention=mosaic")


def test_raise_names_every_bad_request_including_token_ids_out_of_range(llm):
    with pytest.raises(ValueError) as e:
        llm.generate([[1, 2], [1] * 100, [1, -5], [], [3, 300]], GREEDY)
    msg = str(e.value)
    for i, needle in [
        (1, "max_model_len"),
        (2, "token id -5 is out of range"),
        (3, "0 tokens; at least 1"),
        (4, "token id 300 is out of range"),
    ]:
        assert f"request {i}: " in msg and needle in msg, msg
    assert "request 0" not in msg


@pytest.mark.parametrize("prompts", [None, 5, b"hi"])
def test_prompts_that_are_not_prompts(llm, prompts):
    for call in (llm.generate, llm.precompile):
        with pytest.raises(ValueError, match="prompts must be a str, a list of token ids, a dict"):
            call(prompts, GREEDY)


def test_precompile_checks_requests_like_generate(llm):
    with pytest.raises(ValueError, match="request 1: prompt token id 256 is out of range"):
        llm.precompile([[1, 2], [1, 256]], GREEDY)
    with pytest.raises(ValueError, match="stop_token_ids contains 999"):
        llm.precompile([[1, 2]], SamplingParams(max_tokens=2, stop_token_ids=[999]))
    for bad in (0, -1, "x", True):
        with pytest.raises(ValueError, match="max_workers"):
            llm.precompile([[1, 2]], GREEDY, max_workers=bad)


@pytest.mark.parametrize("top_k", [2**31 - 1, 2**31, 2**40])
def test_top_k_beyond_int32_means_no_cut(llm, top_k):
    """A top_k at or above the vocabulary keeps every token; values past int32 used to overflow
    the host batch (an OverflowError that took down the call's other requests)."""
    sp = dict(temperature=0.9, seed=4, max_tokens=5)
    outs = llm.generate(
        [[1, 2, 3], [4, 5]], [SamplingParams(**sp, top_k=top_k), GREEDY], on_error="return"
    )
    assert all(o.error is None for o in outs)
    uncut = llm.generate([[1, 2, 3]], SamplingParams(**sp, top_k=-1))[0]
    assert outs[0].outputs[0].token_ids == uncut.outputs[0].token_ids


def test_one_numpy_array_is_one_prompt(llm):
    """A 1-D integer array is one prompt, as a list of ints is (and as it is inside a dict); a
    2-D array is a batch of rows."""
    ref = llm.generate([[5, 6, 7]], GREEDY)[0].token_ids
    outs = llm.generate(np.array([5, 6, 7], np.int32), GREEDY)
    assert len(outs) == 1 and outs[0].token_ids == ref and outs[0].prompt_token_ids == [5, 6, 7]
    assert [o.token_ids for o in llm.generate(np.array([[5, 6, 7]] * 2), GREEDY)] == [ref] * 2


def test_rejected_request_keeps_its_prompt(llm):
    too_long = list(range(1, 70))
    outs = llm.generate(
        [too_long, {"prompt_token_ids": [1, -5], "prompt": "p"}, [1, 2]], GREEDY, on_error="return"
    )
    assert outs[0].error and outs[0].prompt_token_ids == too_long
    assert outs[1].error and (outs[1].prompt, outs[1].prompt_token_ids) == ("p", [1, -5])
    assert outs[2].error is None


@pytest.mark.parametrize(
    "kw, needle",
    [
        (dict(tensor_parallel_size=2), "tensor_parallel_size=2 is invalid: JAX sees 1 cpu"),
        (dict(tensor_parallel_size=3), "num_heads=4 is not divisible by tensor_parallel_size=3"),
        (dict(kv_cache_dtype="fp16"), "kv_cache_dtype='fp16' is invalid"),
        (dict(gpu_memory_utilization=1.5), "gpu_memory_utilization=1.5 is invalid"),
        (dict(gpu_memory_utilization="0.9"), "gpu_memory_utilization='0.9' is invalid"),
        (dict(memory_fraction="0.5"), "memory_fraction='0.5' is invalid: must be a number"),
        (dict(dtype="float64"), "dtype='float64' is invalid"),
        (
            dict(trust_remote_code=True, worker_cls="x"),
            r"unknown engine argument\(s\) \['worker_cls'\]",
        ),
        (
            dict(task="embed"),
            "task='embed' is invalid: jaxinfer runs generative models only .*"
            "allowed: 'auto', 'generate'",
        ),
        (dict(runner="pooling"), "runner='pooling' is invalid"),
        (
            dict(pipeline_parallel_size=2),
            "pipeline_parallel_size=2 is invalid: one pipeline stage "
            r"\(tensor_parallel_size splits a model\); allowed: 1",
        ),
        (dict(load_format="dummy"), "load_format='dummy' is invalid"),
        (dict(block_size=8, page_size=16), "block_size .* and page_size differ"),
        (dict(max_logprobs=-1), r"max_logprobs=-1 is invalid: must be an integer in \[0, 20\]"),
    ],
)
def test_vllm_constructor_arguments_checked(llm, kw, needle):
    cfg, params = llm.engine.model_config, llm.engine.runner.params
    with pytest.raises(ValueError, match=needle):
        LLM.from_params(cfg, params, **kw)


def test_vllm_constructor_arguments_accepted(llm):
    """What vLLM users paste: dtype="auto" (float32 on the CPU), enforce_eager (no effect),
    tensor_parallel_size=1, kv_cache_dtype="auto", gpu_memory_utilization (GPU only: the CPU pool
    is sized as without it), enable_prefix_caching, seed."""
    cfg, params = llm.engine.model_config, llm.engine.runner.params
    other = LLM.from_params(
        cfg,
        params,
        max_model_len=64,
        num_pages=32,
        max_num_seqs=4,
        dtype="auto",
        enforce_eager=True,
        tensor_parallel_size=1,
        kv_cache_dtype="auto",
        gpu_memory_utilization=0.9,
        enable_prefix_caching=False,
        seed=3,
    )
    assert other.engine.resolved.dtype == "float32" and other.engine.resolved.engine.seed == 3
    assert (
        other.generate([[5, 6, 7]], GREEDY)[0].token_ids
        == llm.generate([[5, 6, 7]], GREEDY)[0].token_ids
    )


# vLLM's `LLM` arguments without effect here, each at vLLM's default (silent)
VLLM_DEFAULTS = dict(
    trust_remote_code=False,
    swap_space=4,
    disable_log_stats=True,
    enable_chunked_prefill=None,
    compilation_config=None,
    tokenizer_mode="auto",
    max_cpu_loras=None,
    revision=None,
    download_dir=None,
    task="generate",
    runner="auto",
    pipeline_parallel_size=1,
    load_format="auto",
)


def _check_block_arguments(other) -> None:
    """``other`` (block_size=8, num_gpu_blocks_override=40, max_logprobs=2) has 8-token pages, 40
    of them (39 usable) and refuses 3 prompt logprobs per token."""
    ec = other.engine.resolved.engine
    assert (ec.page_size, ec.num_pages, ec.max_logprobs) == (8, 40, 2)
    assert other.engine.block_manager.num_usable_pages == 39
    with pytest.raises(
        ValueError,
        match="3 log-probabilities per token requested; this engine gives at most max_logprobs=2",
    ):
        other.generate([[1, 2]], SamplingParams(prompt_logprobs=3, max_tokens=1))


def _llm_with_ineffective_arguments(cfg, params) -> LLM:
    """An `LLM` given six vLLM arguments without effect here at other than vLLM's defaults
    (each one warning line), and ``download_dir`` (silent: no hub id)."""
    return LLM.from_params(
        cfg,
        params,
        max_model_len=64,
        num_pages=32,
        max_num_seqs=4,
        trust_remote_code=True,
        swap_space=0,
        disable_log_stats=False,
        enable_chunked_prefill=False,
        compilation_config={"level": 3},
        max_cpu_loras=4,  # vLLM's multi-LoRA example sets it
        download_dir="/tmp/x",  # vLLM's hub cache: no hub id here, silent
    )


def _check_refusals(cfg, params) -> None:
    """float16 on a GPU, a hub id not in the offline cache, a non-dict ``hf_overrides`` and a
    ``revision`` without a hub id are refused, each naming what is wrong."""
    from jaxinfer.config import EngineConfig, resolve

    with pytest.raises(
        ValueError, match="dtype='float16' is invalid: the GPU kernels are not validated in float16"
    ):
        resolve(cfg, EngineConfig(dtype="half"), "gpu")
    with pytest.raises(
        FileNotFoundError,
        match=r"model 'jaxinfer-tests/none' is no local path, and Hugging Face hub id "
        r"'jaxinfer-tests/none' could not be resolved \(HF_HUB_OFFLINE=1",
    ):
        LLM("jaxinfer-tests/none")
    with pytest.raises(ValueError, match="hf_overrides must be a dict"):
        LLM("jaxinfer-tests/none", hf_overrides=lambda c: c)
    with pytest.raises(ValueError, match="revision names a model's hub revision"):
        LLM.from_params(cfg, params, revision="main")


def test_vllm_engine_arguments_map_or_warn(llm, caplog):
    """vLLM's `LLM` arguments: ``block_size`` is the KV page size and ``num_gpu_blocks_override``
    the pool's block count (vLLM V1's block 0 is a null block, as our page 0); ``max_logprobs``
    caps a request's (prompt) logprobs; ``task``/``runner`` "generate" and
    ``pipeline_parallel_size=1`` are what runs. An argument without effect here is silent at
    vLLM's default value and one warning line otherwise (vLLM would act on it); a value that
    cannot be honoured is a ValueError (`test_vllm_constructor_arguments_checked`); float16 is
    refused on a GPU (kernels not validated), run on the CPU (test_vllm_api.py); a hub id not in
    the HF cache offline is the hub's error naming the id (tests/checkpoints/test_hub.py)."""
    cfg, params = llm.engine.model_config, llm.engine.runner.params
    with caplog.at_level("WARNING", logger="jaxinfer"):
        other = LLM.from_params(
            cfg,
            params,
            max_model_len=64,
            block_size=8,
            num_gpu_blocks_override=40,
            max_num_seqs=4,
            max_logprobs=2,
            **VLLM_DEFAULTS,
        )
        assert not caplog.records
        _check_block_arguments(other)
        _llm_with_ineffective_arguments(cfg, params)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 6 and all(" has no effect: " in m for m in lines), lines
    assert "trust_remote_code=True has no effect: no model code is loaded" in lines[0]
    _check_refusals(cfg, params)


def test_update_params_equals_a_fresh_llm_without_recompiling(llm):
    """Issue 18 item 5: perturbed weights give exactly the outputs of `LLM.from_params` on them,
    with no new compile; the old weights come back the same way (the 40-token prompt's cached
    pages, computed with other weights, are not reused). A mismatch names the leaf."""
    cfg, old = llm.engine.model_config, llm.engine.runner.params
    prompts = [[5, 6, 7], [9, 8, 7, 6, 5, 4, 3, 2, 1], [42], list(range(3, 43))]  # 2 full pages
    sp = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    before = [o.token_ids for o in llm.generate(prompts, sp)]
    leaves, treedef = jax.tree_util.tree_flatten(old)
    keys = jax.random.split(jax.random.key(1), len(leaves))
    new = jax.tree_util.tree_unflatten(
        treedef,
        [
            x + 0.5 * jnp.std(x) * jax.random.normal(k, x.shape, x.dtype)
            for x, k in zip(leaves, keys)
        ],
    )
    compiles = llm.engine.stats().num_compiles
    llm.update_params(new)
    got = [o.token_ids for o in llm.generate(prompts, sp)]
    assert llm.engine.stats().num_compiles == compiles
    fresh = LLM.from_params(cfg, new, max_model_len=64, num_pages=32, max_num_seqs=4)
    assert got == [o.token_ids for o in fresh.generate(prompts, sp)] and got != before
    llm.update_params(old)
    assert [o.token_ids for o in llm.generate(prompts, sp)] == before
    assert llm.engine.stats().num_compiles == compiles
    with pytest.raises(
        ValueError, match=r"params\['embed'\].*is float16\[256, 64\], expected float32"
    ):
        llm.update_params({**old, "embed": old["embed"].astype(jnp.float16)})
    with pytest.raises(ValueError, match="tree differs"):
        llm.update_params({k: v for k, v in old.items() if k != "embed"})


def test_engine_door_refuses_text_with_a_hint(llm):
    """vLLM's ``add_request`` takes text; ours takes token ids and says so."""
    with pytest.raises(ValueError, match="not a str: tokenize it first"):
        llm.engine.add_request("hi", GREEDY)
    assert not llm.engine.has_unfinished()
