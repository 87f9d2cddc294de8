"""fp8 KV calibration (`EngineConfig.calculate_kv_scales`): the K/V means the engine measures
(`kv_means`) against HF transformers' own cache (post-RoPE keys, values) on SmolLM2, and the
engine setting them on fp8 pools only, kept through sleep."""

import numpy as np
import pytest

from jaxinfer import LLM, SamplingParams
from jaxinfer.engine.llm_engine import calibration_ids
from jaxinfer.runner.model_runner import kv_means


def test_kv_means_match_hf_cache(llm, hf_model):
    import torch

    ids = calibration_ids(llm.get_tokenizer(), 128)
    assert ids.shape == (128,) and len(set(ids.tolist())) > 50
    runner = llm.engine.runner
    got = kv_means(runner.params, runner.run_config, ids, 16)
    with torch.inference_mode():
        out = hf_model(torch.tensor([ids.tolist()]), use_cache=True)
    past = getattr(out, "cache", None) or out.past_key_values  # transformers 5: cache
    for mine, name in zip(got, ("keys", "values")):
        ref = np.stack([getattr(layer, name)[0].mean(1).numpy() for layer in past.layers])
        assert mine.shape == ref.shape == (30, 3, 64)
        np.testing.assert_allclose(mine, ref, rtol=0, atol=1e-5 * np.abs(ref).max())  # 2e-7 seen


@pytest.fixture(scope="module")
def tiny_engines(tiny_text_cfg, tiny_text_params, tiny_tokenizer):
    kw = dict(max_model_len=64, max_num_seqs=4, num_pages=24, dtype="float32")
    return {
        name: LLM.from_params(
            tiny_text_cfg, tiny_text_params, tokenizer=tiny_tokenizer, **kw, **extra
        )
        for name, extra in (
            ("auto", {}),
            ("fp8", dict(kv_cache_dtype="fp8")),
            ("fp8_off", dict(kv_cache_dtype="fp8", calculate_kv_scales=False)),
        )
    }


def test_engine_sets_means_on_fp8_pools(
    tiny_engines, tiny_text_cfg, tiny_text_params, tiny_tokenizer
):
    want = kv_means(tiny_text_params, tiny_text_cfg, calibration_ids(tiny_tokenizer), 16)
    runner = tiny_engines["fp8"].engine.runner
    for name, m in zip(("k_mean", "v_mean"), want):
        assert np.abs(m).max() > 1e-3
        np.testing.assert_array_equal(np.asarray(getattr(runner.kv, name)), m)
    for other in ("auto", "fp8_off"):
        assert tiny_engines[other].engine.runner.kv.k_mean is None
    runner.sleep(1)
    runner.wake_up()
    np.testing.assert_array_equal(np.asarray(runner.kv.v_mean), want[1])


def test_calibrated_fp8_generates_as_float_kv(tiny_engines):
    greedy = SamplingParams(temperature=0.0, max_tokens=8)
    prompts = ["hello there", "the cat sat on the mat", "a"]
    want = [o.outputs[0].token_ids for o in tiny_engines["auto"].generate(prompts, greedy)]
    got = [o.outputs[0].token_ids for o in tiny_engines["fp8"].generate(prompts, greedy)]
    assert all(len(g) == 8 for g in got)
    assert all(g[:4] == w[:4] for g, w in zip(got, want)), (got, want)
