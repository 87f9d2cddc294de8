"""LLM.sleep / wake_up with vLLM's meaning (``vllm.LLM.sleep``: level 1 offloads the weights to
host memory and discards the KV cache; level 2 discards both, the weights reloaded by the caller;
``wake_up(tags)`` restores "weights" and "kv_cache", separately when tagged). The reference is the
same engine's output before sleeping."""

import jax
import numpy as np
import pytest

from jaxinfer import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
PROMPTS = [[1, 5, 9, 2, 7], [3, 3, 8]]


def ids(llm: LLM) -> list[list[int]]:
    return [
        list(o.outputs[0].token_ids)
        for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY)
    ]


@pytest.fixture(scope="module")
def llm(tiny_llm):
    return tiny_llm(text=False, max_num_seqs=3)  # its own engine: sleeping deletes its arrays


def test_sleep_levels_free_device_arrays_and_wake_up_gives_the_same_outputs(llm):
    runner, before = llm.engine.runner, ids(llm)
    host = jax.tree.map(np.array, runner.params)
    caller = jax.tree.leaves(runner.params)
    llm.sleep(level=1)
    assert all(a.is_deleted() for a in jax.tree.leaves(runner.kv))
    assert all(isinstance(a, jax.ShapeDtypeStruct) for a in jax.tree.leaves(runner.params))
    assert not any(a.is_deleted() for a in caller)  # the caller's (from_params') tree is intact
    with pytest.raises(RuntimeError, match="asleep"):
        ids(llm)
    llm.wake_up(tags=["weights"])  # vLLM's RL pattern: weights first, then the cache
    with pytest.raises(RuntimeError, match="asleep"):
        ids(llm)
    llm.wake_up(tags=["kv_cache"])
    assert ids(llm) == before
    llm.sleep(level=2)
    llm.wake_up()
    with pytest.raises(RuntimeError, match="update_params"):
        ids(llm)
    llm.update_params(host)
    assert ids(llm) == before


def test_sleep_refuses_a_busy_engine_and_bad_arguments(llm):
    with pytest.raises(ValueError, match="level=3"):
        llm.sleep(level=3)
    llm.engine.add_request([1, 2, 3], GREEDY)
    with pytest.raises(RuntimeError, match="unfinished"):
        llm.sleep()
    llm.engine.abort_all()
    with pytest.raises(ValueError, match="'gpu'"):
        llm.wake_up(tags=["gpu"])
    assert ids(llm)  # still awake and serving
