"""Probe: where the engine core's start-up goes: LLM construction (no precompile), then the whole
planned set's precompile (`LLM.precompile()`, as the server does before /health), under cProfile.

    python scripts/probes/startup_profile.py CHECKPOINT CACHE_DIR   # run twice: cold, then warm
"""

import cProfile
import os
import pstats
import sys
import time

sys.path.insert(0, os.getcwd())


def main(checkpoint: str, cache_dir: str) -> None:
    t0 = time.perf_counter()
    from jaxinfer import LLM

    t1 = time.perf_counter()
    pr = cProfile.Profile()
    pr.enable()
    llm = LLM(
        model=checkpoint,
        max_model_len=2048,
        max_num_seqs=256,
        max_num_batched_tokens=8192,
        compilation_cache_dir=cache_dir,
        precompile=False,
    )
    t2 = time.perf_counter()
    info = llm.precompile()
    t3 = time.perf_counter()
    pr.disable()
    print(
        f"PHASES import {t1 - t0:.1f}s  LLM() {t2 - t1:.1f}s  precompile {t3 - t2:.1f}s {info}",
        flush=True,
    )
    st = pstats.Stats(pr)
    st.sort_stats("cumulative").print_stats(45)
    st.sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] in ("-h", "--help"):
        print(__doc__)
        sys.exit(0 if sys.argv[1:2] in (["-h"], ["--help"]) else 2)
    main(*sys.argv[1:])
