"""Engine counters and the per-step log (host side, no JAX): read by tests, benchmarks and the CLI,
never by the engine's decisions."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple


class StepRecord(NamedTuple):
    """One read-back step of `EngineStats.step_log` (``time.perf_counter`` seconds): ``wait_s``
    the host blocked on the device for its tokens (near 0: the host set the pace); host work of
    the `LLMEngine.step` call that read it back: ``schedule_s`` and ``launch_s`` (build,
    transfer, dispatch) of the next step, 0 when the read-back came first, and ``post_s``."""

    shape_key: tuple
    rows: int
    t_done: float
    wait_s: float = 0.0
    schedule_s: float = 0.0
    launch_s: float = 0.0
    post_s: float = 0.0


@dataclass
class EngineStats:
    """What one engine did so far.

    num_steps:             steps dispatched.
    num_lazy_compiles:     step shapes first compiled inside a step (not by `precompile`).
    num_overlapped_steps:  steps dispatched while the previous one was still in flight.
    max_kv_len_seen:       the largest KV length any step wrote (<= max_model_len).
    compiled_shapes:       `ShapeKey`s compiled so far (ahead of time or not).
    step_log:              None, or a list that receives one `StepRecord` per read-back step
                           (set it to ``[]`` to start logging).
    """

    num_steps: int = 0
    num_lazy_compiles: int = 0
    num_overlapped_steps: int = 0
    max_kv_len_seen: int = 0
    compiled_shapes: set = field(default_factory=set)
    step_log: list | None = None

    @property
    def num_compiles(self) -> int:
        """Distinct compiled step shapes so far (bounded by the buckets)."""
        return len(self.compiled_shapes)
