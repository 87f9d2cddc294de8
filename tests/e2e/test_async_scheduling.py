"""Asynchronous scheduling (step n+1 dispatched before step n's tokens are read back) changes no
output: the same requests, run with `EngineConfig.async_scheduling` on and off on the tiny random
model, give identical tokens, texts and finish reasons, with preemption (a small KV pool), stop
strings, stop tokens, seeded sampling and a repetition penalty (which makes its steps
synchronous) in one continuous batch."""

import pytest

from jaxinfer import SamplingParams

from .conftest import CHAT_PROMPTS, PAGE_SIZE, PLAIN_PROMPTS


@pytest.fixture(scope="module")
def small_pool_llm(tiny_llm):
    # 9 usable pages of 16 tokens: each request fits alone, all of them together do not
    return tiny_llm(max_model_len=256, page_size=PAGE_SIZE, num_pages=10, max_compiles=16)


def _requests(llm):
    prompts = PLAIN_PROMPTS + [
        {"prompt_token_ids": llm.apply_chat_template([{"role": "user", "content": c}])}
        for c in CHAT_PROMPTS
    ]
    greedy = SamplingParams(max_tokens=40, temperature=0.0)
    # a stop string and a stop token that greedy decoding reaches: from a first run
    text2, ids3 = (llm.generate(prompts[i], greedy)[0] for i in (2, 3))
    stop_str, stop_id = text2.text[10:13], ids3.token_ids[12]
    params = [
        SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True),  # length
        SamplingParams(max_tokens=40, temperature=0.9, top_k=40, seed=7),  # seeded sampling
        SamplingParams(max_tokens=40, temperature=0.0, stop=[stop_str]),  # stop string
        SamplingParams(max_tokens=40, temperature=0.0, stop_token_ids=[stop_id]),  # stop token
        SamplingParams(max_tokens=30, temperature=0.7, repetition_penalty=1.3, seed=3),
    ]
    return prompts, params, stop_str, list(ids3.token_ids).index(stop_id) + 1


def test_async_and_sync_scheduling_give_identical_outputs(small_pool_llm):
    llm = small_pool_llm
    eng = llm.engine
    prompts, params, stop_str, stop_len = _requests(llm)
    results = {}
    for mode in (False, True):
        eng.async_scheduling = mode
        before = eng.stats().num_overlapped_steps
        outs = llm.generate(prompts, params, use_tqdm=False)
        results[mode] = [
            (o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason) for o in outs
        ]
        overlapped = eng.stats().num_overlapped_steps - before
        preempted = sum(o.metrics.num_preemptions for o in outs)
        assert preempted > 0, "the pool is meant to be too small for all requests at once"
        assert (overlapped > 0) == mode
        assert not eng.has_unfinished()
        bm = eng.block_manager
        assert bm.num_free_pages == bm.num_usable_pages
    eng.async_scheduling = True
    assert results[True] == results[False]
    reasons = [r[2] for r in results[True]]
    assert reasons[0] == "length" and len(results[True][0][0]) == 48
    assert stop_str not in results[True][2][1] and reasons[2] == "stop"
    assert reasons[3] == "stop" and len(results[True][3][0]) == stop_len  # on the stop token
