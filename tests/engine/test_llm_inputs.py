"""`LLM.generate` input checking on a tiny random model (`LLM.from_params`, no tokenizer): malformed
token-id prompts are rejected with a clear per-request error, never converted, and never take
down the other requests of the call."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer import LLM, SamplingParams
from jaxinfer.config import ModelConfig
from jaxinfer import models

GREEDY = SamplingParams(temperature=0.0, max_tokens=3)


@pytest.fixture(scope="module")
def llm():
    cfg = ModelConfig("qwen3", 256, 64, 96, 2, 4, 2, 16)
    return LLM.from_params(cfg, models.init_params(cfg, jax.random.key(0), jnp.float32),
                           max_model_len=64, num_pages=32, max_num_seqs=4)


@pytest.mark.parametrize("bad, needle", [
    ({"prompt_token_ids": "12"}, "must be a list of ints; got str"),
    ({"prompt_token_ids": ["1", "2"]}, "holds '1' (str)"),
    ({"prompt_token_ids": None}, "got NoneType"),
    ({"prompt_token_ids": 5}, "got int"),
    ({"prompt_token_ids": [1, True]}, "holds True (bool)"),
    ({"prompt_token_ids": [1, 2.0]}, "holds 2.0 (float)"),
    ({"prompt_token_ids": np.ones((2, 2), np.int32)}, "1-D integer array"),
    ({1: 2}, "needs 'prompt' or 'prompt_token_ids'"),
    ({"prompt": None}, "'prompt' must be a str"),
    ([1, [2]], "holds [2] (list)"),
    ("text", "has no tokenizer"),
])
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


def test_stop_strings_need_a_tokenizer(llm):
    outs = llm.generate([[1, 2], [3, 4]], [SamplingParams(stop=["a"], max_tokens=2), GREEDY],
                        on_error="return")
    assert "stop_token_ids" in outs[0].error and outs[1].error is None


def test_from_params_and_engine_argument_errors(llm):
    cfg, params = llm.engine.model_config, llm.engine.params
    with pytest.raises(ValueError, match="must be a jaxinfer.config.ModelConfig; got dict"):
        LLM.from_params(cfg.to_dict(), params)
    with pytest.raises(ValueError, match="seed='a' is invalid"):
        LLM.from_params(cfg, params, seed="a")
    with pytest.raises(ValueError, match="a list holding NoneType"):
        llm.generate([[1], [2]], [GREEDY, None])
    with pytest.raises(ValueError, match=r"unknown engine argument\(s\) \['attention'\]; allowed: "
                       r"\[.*'kernels'"):
        LLM.from_params(cfg, params, attention="mosaic")
    with pytest.raises(ValueError, match="kernels: 'attention=mosaic' is invalid"):
        LLM.from_params(cfg, params, kernels="attention=mosaic")


def test_raise_names_every_bad_request_including_token_ids_out_of_range(llm):
    with pytest.raises(ValueError) as e:
        llm.generate([[1, 2], [1] * 100, [1, -5], [], [3, 300]], GREEDY)
    msg = str(e.value)
    for i, needle in [(1, "max_model_len"), (2, "token id -5 is out of range"),
                      (3, "0 tokens; at least 1"), (4, "token id 300 is out of range")]:
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
    outs = llm.generate([[1, 2, 3], [4, 5]], [SamplingParams(**sp, top_k=top_k), GREEDY],
                        on_error="return")
    assert all(o.error is None for o in outs)
    uncut = llm.generate([[1, 2, 3]], SamplingParams(**sp, top_k=-1))[0]
    assert outs[0].outputs[0].token_ids == uncut.outputs[0].token_ids
