"""JAX's persistent compilation cache for the engine's compiled steps.

The 36-layer Qwen3-8B step takes 8-13 s to compile per shape bucket on the H200 (BENCHMARKS.md),
so a start-up that visits 15 buckets spends minutes compiling. With a cache directory a restarted
engine loads those executables from disk instead (the role of vLLM's torch.compile cache).
"""

from __future__ import annotations

import os

import jax


def enable(path: str | os.PathLike) -> str:
    """Point JAX's persistent compilation cache at ``path`` (created if missing) and cache every
    compile, however short.

    JAX's cache setting is process-wide: every later ``jax.jit`` compile in this process reads and
    writes the same directory. Entries are keyed by the program, the JAX/XLA version and the
    device, so one directory can serve several models and machines.

    Returns:
        The absolute path in use.
    Raises:
        ValueError: ``path`` exists and is not a directory, or cannot be created.
    """
    path = os.path.abspath(os.path.expanduser(os.fspath(path)))
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"compilation_cache_dir={path!r} is invalid: it exists and is not a "
                         "directory")
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise ValueError(f"compilation_cache_dir={path!r} cannot be created: {e.strerror}") from None
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    return path
