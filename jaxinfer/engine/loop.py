"""The step loop (host side) of `LLMEngine` and `jaxinfer.engine.dry_run`. Source: vLLM v1's async
scheduling."""

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from jaxinfer.engine.scheduled_batch import ScheduledBatch
from jaxinfer.engine.scheduler import Scheduler
from jaxinfer.engine.sequence import Sequence
from jaxinfer.stats import EngineStats


@dataclass
class Launched:
    """A launched step: its ``batch``, padded inputs ``hb`` (`HostBatch`), the runner's
    ``forward`` (its dispatched forward), ``sampled`` (the sampler's handle; None until
    dispatched: a constrained step samples once the grammars have advanced) and ``prompt``
    (the prompt scorer's arrays, or None); ``sync``: read it back before the next schedule."""

    batch: ScheduledBatch
    hb: Any = None
    forward: Any = None
    sampled: Any = None
    prompt: Any = None
    sync: bool = False


class StepLoop:
    """Drives ``scheduler``. ``launch(Launched, previous Launched | None)`` dispatches (fills
    the record's handles); ``complete(Launched, (schedule_s, launch_s)) -> finished`` reads
    back and postprocesses; ``sample(Launched)`` (None: none) ends a launch once the previous
    step is completed."""

    def __init__(
        self,
        scheduler: Scheduler,
        launch: Callable,
        complete: Callable,
        *,
        sample: Callable | None = None,
        async_scheduling: bool = True,
        stats: EngineStats | None = None,
    ) -> None:
        self.scheduler, self.launch, self.complete, self.sample = (
            scheduler,
            launch,
            complete,
            sample,
        )
        self.async_scheduling = async_scheduling
        self.stats = stats if stats is not None else EngineStats()
        self.in_flight: Launched | None = None

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or self.in_flight is not None

    def step(self) -> list[Sequence]:
        """Complete the step in flight first if it must be (synchronous, or a penalty reads its
        history); schedule and launch the next, complete the previous while it runs, `sample` the
        launch. Returns the sequences finished."""
        finished: list[Sequence] = []
        prev = self.in_flight
        if prev is not None and (prev.sync or not self.async_scheduling):
            finished += self._complete(prev, (0.0, 0.0))
            prev = None
        t0 = time.perf_counter()
        batch = self.scheduler.schedule()
        t1 = time.perf_counter()
        launched = None
        if batch is not None:  # a penalty reads the history, a proposer the tokens: the next
            sync = batch.num_draft_tokens > 0 or self.scheduler.may_speculate()  # step waits
            launched = Launched(batch, sync=sync or any(s.params.needs_history for s in batch.seqs))
            self.launch(launched, prev)
        times = (t1 - t0, time.perf_counter() - t1)
        if prev is not None:
            self.stats.num_overlapped_steps += launched is not None
            finished += self._complete(prev, times)
        if launched is not None and self.sample is not None:
            self.sample(launched)
        self.in_flight = launched
        if launched is not None and not self.async_scheduling:
            finished += self._complete(launched, times)
        return finished

    def _complete(self, done: Launched, times: tuple[float, float]) -> list[Sequence]:
        if self.in_flight is done:
            self.in_flight = None
        return self.complete(done, times)
