"""`scripts/bench_hf_decode.py` (the HF transformers baseline of the decode benchmarks) on the
CPU with a tiny Qwen3-MoE: its config mapping gives HF the model `ModelConfig` describes (HF's
own config read back equals it), and a decode-step timing runs through HF's static cache."""

import math

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from jaxinfer.config import ModelConfig  # noqa: E402
from scripts.bench_hf_decode import hf_config, random_model, step_ms  # noqa: E402

TINY_MOE = ModelConfig(
    "qwen3_moe",
    256,
    64,
    96,
    2,
    4,
    2,
    16,
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    norm_topk_prob=True,
    mlp_only_layers=(1,),
    max_position_embeddings=128,
    tie_word_embeddings=False,
)


def test_hf_config_round_trips_and_times_a_step():
    import dataclasses

    config = hf_config(TINY_MOE)
    back = ModelConfig.from_hf_config(config.to_dict())
    ignore = ("bos_token_id", "eos_token_ids")
    want, got = (
        {k: v for k, v in dataclasses.asdict(c).items() if k not in ignore}
        for c in (TINY_MOE, back)
    )
    assert got == want
    model = random_model(config, "cpu")
    assert type(model).__name__ == "Qwen3MoeForCausalLM"
    # runs end to end; its value is a difference of two timings, noise-bound on a busy CPU (the
    # figure is the GPU benchmark's, not a unit test's)
    assert math.isfinite(step_ms(model, batch=2, context=8, steps=2, device="cpu"))
