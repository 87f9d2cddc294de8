"""JAX's persistent compilation cache for the engine's compiled steps: a restarted engine loads
its step executables from disk instead of compiling each shape bucket again (the role of vLLM's
torch.compile cache)."""

from __future__ import annotations

import os

import jax


def enable(path: str | os.PathLike) -> str:
    """Point JAX's (process-wide) persistent compilation cache at ``path`` (created if missing)
    and cache every compile, however short; entries are keyed by program, JAX/XLA version and
    device. Returns the absolute path. Raises ValueError: ``path`` is not a directory or cannot
    be created."""
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
