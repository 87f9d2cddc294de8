"""The engine's step loop: schedule, launch, complete, in the asynchronous-scheduling order.

One `StepLoop.step`: if the step in flight must be read back first (synchronous scheduling, or a
row with a repetition penalty, which needs every token on the host), complete it; schedule the
next batch and launch it (the device runs it asynchronously); then complete the previous step,
whose tokens are read back while the new one runs; without asynchronous scheduling complete the
new one as well. A launched decode row whose input is the previous step's token takes it from that
step's device output (`ScheduledBatch.pending_input`).

`LLMEngine` drives this loop with the device step; the host-only dry run
(`jaxinfer.engine.dry_run`) drives the
same loop with a fake launch and complete, so the two visit the same steps in the same order.
Source: vLLM v1 asynchronous scheduling, SGLang's overlap scheduler.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

from jaxinfer.engine.scheduler import ScheduledBatch, Scheduler
from jaxinfer.engine.sequence import Sequence
from jaxinfer.engine.stats import EngineStats


@dataclass
class Launched:
    """A launched step: its batch, what ``launch`` returned for it, and whether it must be read
    back before the next step is scheduled (``sync``: a row uses a repetition penalty)."""

    batch: ScheduledBatch
    handle: Any
    sync: bool


class StepLoop:
    """Drives ``scheduler`` one step at a time; counts ``stats.num_overlapped_steps``.

    ``launch(batch, previous Launched or None) -> handle`` dispatches without waiting (it may
    read ``previous.handle`` for pending input tokens). ``complete(Launched, (schedule_s,
    launch_s)) -> finished sequences`` reads a step back and postprocesses it; the times are this
    `step` call's host work before the read-back (zeros when the read-back came first).
    """

    def __init__(self, scheduler: Scheduler, launch: Callable, complete: Callable, *,
                 async_scheduling: bool = True, stats: EngineStats | None = None) -> None:
        self.scheduler = scheduler
        self.launch = launch
        self.complete = complete
        self.async_scheduling = async_scheduling
        self.stats = stats if stats is not None else EngineStats()
        self.in_flight: Launched | None = None

    def has_unfinished(self) -> bool:
        """Requests not finished, or a launched step not completed yet."""
        return self.scheduler.has_unfinished() or self.in_flight is not None

    def step(self) -> list[Sequence]:
        """Launch the next step, complete the previous one; returns the sequences finished."""
        finished: list[Sequence] = []
        prev = self.in_flight
        if prev is not None and (prev.sync or not self.async_scheduling):
            finished += self._complete(prev, (0.0, 0.0))
            prev = None
        t0 = time.perf_counter()
        batch = self.scheduler.schedule()
        t1 = time.perf_counter()
        launched = None
        if batch is not None:
            sync = any(s.params.repetition_penalty != 1.0 for s in batch.seqs)
            launched = Launched(batch, self.launch(batch, prev), sync)
        times = (t1 - t0, time.perf_counter() - t1)
        if prev is not None and launched is not None:
            self.stats.num_overlapped_steps += 1
        if prev is not None:
            finished += self._complete(prev, times)
        self.in_flight = launched
        if launched is not None and not self.async_scheduling:
            finished += self._complete(launched, times)
        return finished

    def _complete(self, done: Launched, times: tuple[float, float]) -> list[Sequence]:
        if self.in_flight is done:
            self.in_flight = None
        return self.complete(done, times)

