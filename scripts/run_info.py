"""What every benchmark row records about the code it ran."""

from __future__ import annotations

import datetime
import os
import subprocess


def git_commit() -> str:
    """The commit a benchmark row belongs to: ``$GIT_COMMIT`` when set (a copy of the tree whose
    ``.git`` is missing or stale, as on the device machine), else ``git rev-parse --short HEAD``
    run in the repository, else ""."""
    if os.environ.get("GIT_COMMIT"):
        return os.environ["GIT_COMMIT"]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=root
    )
    return r.stdout.strip()


def xla_flags() -> str | None:
    """``$XLA_FLAGS`` as the run saw it (flags such as command buffers change what a row
    measures), or None when unset."""
    return os.environ.get("XLA_FLAGS") or None


def device_row(bench: str) -> dict:
    """The fields a device benchmark's row starts with: ``bench``, the date, `git_commit`, JAX's
    version, the first device's kind and `xla_flags`."""
    import jax

    return dict(
        bench=bench,
        date=datetime.date.today().isoformat(),
        commit=git_commit(),
        jax=jax.__version__,
        device=jax.devices()[0].device_kind,
        xla_flags=xla_flags(),
    )
