"""The two tiers of every kernel suite, as parameters of one suite (as JAX's own Pallas tests):
``interpret`` (the Pallas interpreter on the CPU, the default run) and ``compiled`` (on a CUDA GPU,
marked ``gpu``: ``python -m pytest -m gpu tests/kernel_tests`` on the device machine)."""

from __future__ import annotations

import jax
import pytest

ON_GPU = jax.default_backend() == "gpu"
GPU = [pytest.mark.gpu, pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")]

MODES = ["interpret", pytest.param("compiled", marks=GPU)]


def case_id(case) -> str:
    return "-".join(str(getattr(x, "__name__", x)) for x in case)


def runs(cases, gpu_cases=(), gpu_marks=()):
    """``(mode, case)`` parameters: every case interpreted, and every case plus ``gpu_cases``
    (real model sizes, too slow to interpret) compiled."""
    out = [pytest.param("interpret", c, id=f"interpret-{case_id(c)}") for c in cases]
    out += [
        pytest.param("compiled", c, marks=[*GPU, *gpu_marks], id=f"compiled-{case_id(c)}")
        for c in [*cases, *gpu_cases]
    ]
    return out
