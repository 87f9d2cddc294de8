"""Host-only dry run of the engine loop: the steps and step shapes a set of requests visits.

No JAX, no model: the scheduler and the batch builder run as `LLMEngine.step` drives them (the
same schedule / postprocess order, asynchronous or not), with a constant sampled token that ends
no request, so each request runs to ``max_tokens`` or ``max_model_len``. This is what
`LLMEngine.plan_shapes` uses to list the shapes to compile ahead of time, and what
scripts/plan_step_shapes.py uses to plan buckets. Requests that stop early (EOS, a stop token or
a stop string) take fewer steps, and the rows left can group into step shapes not listed here.
"""

from __future__ import annotations

from typing import Iterable, Iterator

from jaxinfer.engine.batch_builder import BucketSpec, HostBatch, build_host_batch
from jaxinfer.engine.scheduler import ScheduledBatch, Scheduler
from jaxinfer.engine.sequence import Sequence
from jaxinfer.sampling_params import SamplingParams


def dry_run(scheduler: Scheduler, requests: Iterable[tuple[list[int], SamplingParams]], *,
            buckets: BucketSpec, async_scheduling: bool = True
            ) -> Iterator[tuple[ScheduledBatch, HostBatch]]:
    """Run ``requests`` to completion on ``scheduler`` and yield each step's batch.

    Args:
        scheduler: a fresh `Scheduler` (it is consumed: every request is added and finished).
        requests: (prompt token ids, `SamplingParams`) pairs, added in order.
        buckets: the engine's `BucketSpec`.
        async_scheduling: mirror `LLMEngine`'s asynchronous order (step n+1 is scheduled before
            step n is postprocessed; a batch with a repetition penalty is postprocessed first).
    Yields:
        (`ScheduledBatch`, its padded `HostBatch`) per step, in dispatch order; read the batch
        before advancing the iterator (its sequences advance afterwards).
    Raises:
        ValueError: a request the scheduler rejects (see `Scheduler.add`).
        RuntimeError: the scheduler returns no batch while requests are unfinished.
    """
    stops: set[int] = set()
    for i, (ids, params) in enumerate(requests):
        stops.update(params.stop_token_ids)
        scheduler.add(Sequence(request_id=f"dry-{i}", prompt_token_ids=list(ids), params=params,
                               seed=i))
    token = next(t for t in range(len(stops) + 1) if t not in stops)  # ends no request
    prev: ScheduledBatch | None = None
    prev_sync = False

    def finish(batch: ScheduledBatch) -> None:
        scheduler.postprocess(batch, [token if s else None for s in batch.do_sample])

    while scheduler.has_unfinished() or prev is not None:
        if prev is not None and (prev_sync or not async_scheduling):
            finish(prev)
            prev = None
        batch = scheduler.schedule() if scheduler.has_unfinished() else None
        if batch is None and prev is None and scheduler.has_unfinished():
            raise RuntimeError("dry run: the scheduler returned no batch with requests unfinished")
        if batch is not None:
            yield batch, build_host_batch(batch, page_size=scheduler.page_size, buckets=buckets)
        if prev is not None:
            finish(prev)
        prev = batch
        prev_sync = batch is not None and any(s.params.repetition_penalty != 1.0
                                              for s in batch.seqs)
