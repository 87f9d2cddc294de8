"""Issue 48 item 1 on SmolLM2's real weights (float32, CPU): a random rank-8 LoRA adapter built
with PEFT on HF transformers' model of the same GGUF, on all seven modules with B non-zero, saved
as a PEFT directory and served through ``lora_request``: greedy tokens and prompt
log-probabilities equal HF transformers + PEFT's; a row without the adapter in the same batch
keeps the base model's tokens (HF's)."""

import copy

import numpy as np
import pytest

from jaxinfer import LLM, LoRARequest, SamplingParams

from .conftest import HFGreedy

TOL = 2e-4
STEPS = 12
MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def peft_model(hf_model, tmp_path_factory):
    """(HF + PEFT model with a random rank-8 adapter, its saved directory)."""
    import torch
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    config = LoraConfig(
        r=8, lora_alpha=16, target_modules=MODULES, lora_dropout=0.0, init_lora_weights=False
    )
    model = get_peft_model(copy.deepcopy(hf_model), config).eval()
    with torch.no_grad():  # B non-zero, scaled so the adapter moves but does not wreck the model
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn_like(p) * (0.05 if "lora_B" in name else 0.02))
    path = str(tmp_path_factory.mktemp("lora") / "adapter")
    model.save_pretrained(path)
    return model, path


@pytest.fixture(scope="module")
def lora_llm(smollm_path, smollm_engine):
    return LLM(smollm_path, **smollm_engine, enable_lora=True, max_loras=2, max_lora_rank=8)


def test_lora_matches_hf_peft(lora_llm, peft_model, prompt_ids, hf_greedy):
    """Two rows with the adapter, one without, one batch: greedy tokens as HF + PEFT's (and the
    base model's for the plain row); each adapter row's prompt log-probabilities as HF + PEFT's
    log_softmax within TOL."""
    import torch

    model, path = peft_model
    lora = LoRARequest("random", 1, path)
    ids = [prompt_ids[0], prompt_ids[3], prompt_ids[1]]
    sp = SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True, prompt_logprobs=1)
    out = lora_llm.generate(
        [{"prompt_token_ids": p} for p in ids], sp, lora_request=[lora, lora, None]
    )
    greedy = HFGreedy(model.base_model.model, lora_llm.engine.eos_token_ids)
    for o, p in zip(out[:2], ids[:2]):
        ref = greedy(p, STEPS, ignore_eos=True)
        with torch.inference_mode():
            logits = model(torch.tensor([p])).logits[0].float()
        lps = torch.log_softmax(logits, dim=-1).numpy()
        assert list(o.outputs[0].token_ids) == ref
        got = [entry[t].logprob for entry, t in zip(o.prompt_logprobs[1:], p[1:])]
        want = [lps[i, t] for i, t in enumerate(p[1:])]
        np.testing.assert_allclose(got, want, atol=TOL)
    assert list(out[2].outputs[0].token_ids) == hf_greedy(ids[2], STEPS, ignore_eos=True)[:STEPS]
