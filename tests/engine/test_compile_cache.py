"""EngineConfig.compilation_cache_dir: a second process with the same directory loads the step
executables from JAX's persistent cache (cache hits counted through jax.monitoring) and generates
the same tokens."""

import json
import os
import subprocess
import sys

import pytest
from tiny_model import TINY

SCRIPT = r"""
import json, sys
import jax, jax.numpy as jnp
hits = []
jax.monitoring.register_event_listener(
    lambda name, **kw: hits.append(name) if name == "/jax/compilation_cache/cache_hits" else None)
from jaxinfer import LLM, SamplingParams
from jaxinfer.config import ModelConfig
from jaxinfer import models
cfg = ModelConfig(**TINY)
params = models.init_params(cfg, jax.random.key(0), jnp.float32)
llm = LLM.from_params(cfg, params, max_model_len=64, num_pages=32, max_num_seqs=2,
                      compilation_cache_dir=sys.argv[1])
step_hits = len(hits)
out = llm.generate([{"prompt_token_ids": [1, 2, 3]}, {"prompt_token_ids": [4, 5, 6, 7, 8]}],
                   SamplingParams(temperature=0.0, max_tokens=5))
print(json.dumps({"tokens": [list(o.token_ids) for o in out], "hits": len(hits) - step_hits,
                  "compiles": llm.engine.stats().num_compiles}))
"""


def _run(cache_dir, **env_vars):
    env = dict(os.environ, JAX_PLATFORMS="cpu", **env_vars)
    env.pop("JAX_COMPILATION_CACHE_DIR", None)  # the run-wide cache of tests/conftest.py
    script = SCRIPT.replace("**TINY", f"**{TINY!r}")
    r = subprocess.run(
        [sys.executable, "-c", script, str(cache_dir)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_second_process_loads_compiled_steps(tmp_path):
    """The default, ``"auto"``, with no JAX cache set: the user's cache directory (vLLM keeps its
    compile cache in ~/.cache/vllm), here $XDG_CACHE_HOME/jaxinfer/jax."""
    cache = tmp_path / "jaxinfer" / "jax"
    first = _run("auto", XDG_CACHE_HOME=str(tmp_path))
    assert first["compiles"] >= 2 and first["hits"] == 0
    assert any(name.startswith("jit_forward_step") for name in os.listdir(cache)), os.listdir(cache)
    second = _run("auto", XDG_CACHE_HOME=str(tmp_path))
    assert second["tokens"] == first["tokens"]
    assert second["hits"] >= first["compiles"]  # every step shape came from the cache


def test_cache_path_that_is_a_file_is_rejected(tmp_path):
    from jaxinfer.runner.executor import enable_compilation_cache as enable

    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(ValueError, match="not a directory"):
        enable(f)


class _Lowered:
    """Records the compiler options `compile_lowered` passes."""

    def compile(self, compiler_options=None):
        self.options = compiler_options
        return "compiled"


def test_cpu_compiles_at_o0_unless_xla_flags_set_a_level(monkeypatch):
    from jaxinfer.runner.executor import CPU_COMPILER_OPTIONS, compile_lowered

    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=1")
    lowered = _Lowered()
    assert compile_lowered(lowered) == "compiled"
    assert lowered.options == CPU_COMPILER_OPTIONS
    monkeypatch.setenv("XLA_FLAGS", "--xla_backend_optimization_level=2")
    compile_lowered(lowered)
    assert lowered.options is None
