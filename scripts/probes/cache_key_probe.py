"""Probe: is each step program's persistent-compilation-cache key the same in a second process?
Run it twice on one CACHE_DIR (a 2-layer random Qwen3-8B-architecture model); the second run
should report hits. Lowers and compiles the first two forwards and the first sampler of the
planned set (`BucketSpec.planned`) as `StepExecutor.precompile` does, printing each lowered
program's hash; JAX's cache-key and compiler loggers print each key component's hash. The first
program's HLO text goes to ``$OUT/hlo_TAG.txt`` (default /tmp).

    python scripts/probes/cache_key_probe.py CACHE_DIR TAG
"""

import hashlib
import logging
import os
import sys
import time

sys.path.insert(0, os.getcwd())


def main(cache_dir: str, tag: str) -> None:
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
        compilation_cache_dir=cache_dir,
    )
    r = llm.engine.runner
    ex, planned = r.executor, r.buckets.planned()
    programs = [("forward", k) for k in planned["forward"][:2]]
    programs.append(("sampler", planned["sampler"][0]))
    for i, (program, key) in enumerate(programs):
        low = ex._lower(program, key, ex._avals(program, key, r.params, r.kv))
        txt = low.as_text(debug_info=False)
        print("HLO", program, key, hashlib.sha256(txt.encode()).hexdigest()[:16], flush=True)
        if i == 0:
            with open(os.path.join(os.environ.get("OUT", "/tmp"), f"hlo_{tag}.txt"), "w") as f:
                f.write(txt)
        t = time.perf_counter()
        low.compile()
        print(f"compiled in {time.perf_counter() - t:.2f} s", flush=True)


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] in ("-h", "--help"):
        print(__doc__)
        sys.exit(0 if sys.argv[1:2] in (["-h"], ["--help"]) else 2)
    main(*sys.argv[1:])
