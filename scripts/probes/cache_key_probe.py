"""Probe: is each step's persistent-compilation-cache key the same in a second process? Run it
twice on one CACHE_DIR (a 2-layer random Qwen3-8B-architecture model); the second run should
report hits. JAX's cache-key and compiler loggers print each key component's hash.

    python scripts/probes/cache_key_probe.py CACHE_DIR TAG
"""

import hashlib
import logging
import os
import sys
import time

sys.path.insert(0, os.getcwd())
import jax
import jax.numpy as jnp

logging.basicConfig(level=logging.WARNING, format="%(name)s %(levelname)s %(message)s")
for n in ("jax._src.cache_key", "jax._src.compiler", "jax._src.compilation_cache"):
    logging.getLogger(n).setLevel(logging.DEBUG)
from jaxinfer import LLM, models
from jaxinfer.config import ModelConfig
from scripts.bench_throughput import QWEN3_8B_HF

cfg = ModelConfig.from_hf_config(dict(QWEN3_8B_HF, model_type="qwen3", num_hidden_layers=2))
llm = LLM.from_params(
    cfg,
    models.init_params(cfg, jax.random.key(0), jnp.bfloat16),
    max_model_len=2048,
    max_num_seqs=256,
    max_num_batched_tokens=8192,
    compilation_cache_dir=sys.argv[1],
)
r = llm.engine.runner
ex = r.executor
for i, key in enumerate(r.buckets.covering_keys()[:3]):
    low = ex._lower("step", key, ex._padding_args("step", r.params, r.kv, key))
    txt = low.as_text(debug_info=False)
    print("HLO", key, hashlib.sha256(txt.encode()).hexdigest()[:16], flush=True)
    if i == 0:
        with open(os.path.join(os.environ.get("OUT", "/tmp"), f"hlo_{sys.argv[2]}.txt"), "w") as f:
            f.write(txt)
    t = time.perf_counter()
    low.compile()
    print(f"compiled in {time.perf_counter() - t:.2f} s", flush=True)
