"""scripts/step_tools.py's `record_steps`: one StepRecord per dispatched step, in read-back
order, with host times."""

import jax
import pytest
from script_module import load_script

from jaxinfer.config import EngineConfig, resolve
from jaxinfer.engine.llm_engine import LLMEngine
from jaxinfer.runner.model_runner import ModelRunner
from jaxinfer.sampling_params import SamplingParams

STEPS = load_script("step_tools")


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_step_log_records_every_step(async_scheduling, tiny_cfg, tiny_params):
    ec = EngineConfig(
        max_model_len=64,
        num_pages=64,
        page_size=4,
        max_num_seqs=4,
        max_num_batched_tokens=32,
        async_scheduling=async_scheduling,
    )
    eng = LLMEngine(
        ModelRunner(tiny_cfg, tiny_params, resolve(tiny_cfg, ec, jax.default_backend()))
    )
    for i, n in enumerate([5, 30, 9]):
        eng.add_request(
            [(5 * i + j) % 250 + 1 for j in range(n)],
            SamplingParams(temperature=0.0, max_tokens=3 + i),
        )
    log = STEPS.record_steps(eng, [])
    while eng.has_unfinished():
        eng.step()
    assert len(log) == eng.stats().num_steps and all(isinstance(r, STEPS.StepRecord) for r in log)
    assert [r.t_done for r in log] == sorted(r.t_done for r in log)
    assert any(not r.shape_key.forward.decode for r in log)  # a step with a prefill chunk
    assert any(r.shape_key.forward.decode and r.rows == 3 for r in log)  # a decode step of 3 rows
    for r in log:
        assert min(r.wait_s, r.schedule_s, r.launch_s, r.post_s) >= 0
        assert 1 <= r.rows <= 4
    # every step but the last was read back by a call that also scheduled and launched one
    assert all(r.launch_s > 0 for r in log[:-1])
