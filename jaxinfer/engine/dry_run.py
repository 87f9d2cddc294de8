"""Host-only dry run of `StepLoop`: the steps requests visit (`LLMEngine.plan_shapes`)."""

from collections.abc import Iterable

from jaxinfer.engine.batch_builder import build_host_batch
from jaxinfer.engine.loop import Launched, StepLoop
from jaxinfer.engine.scheduled_batch import ScheduledBatch
from jaxinfer.engine.scheduler import Scheduler
from jaxinfer.engine.sequence import Sequence
from jaxinfer.sampling_params import SamplingParams
from jaxinfer.step_input import BucketSpec, HostBatch


def dry_run(
    scheduler: Scheduler,
    requests: Iterable[tuple[list[int], SamplingParams]],
    *,
    buckets: BucketSpec,
    async_scheduling: bool = True,
) -> list[tuple[ScheduledBatch, HostBatch]]:
    """Run ``requests`` on the fresh ``scheduler``, sampling a token that ends no request (no
    grammar runs):
    (`ScheduledBatch`, `HostBatch`) per step in launch order. ValueError: a rejected request."""
    stops: set[int] = set(scheduler.eos_token_ids)
    for i, (ids, params) in enumerate(requests):
        stops.update(params.stop_token_ids)
        max_tokens = params.max_tokens or scheduler.max_model_len - len(ids)
        for j in range(params.n):  # as `LLMEngine.add_request`: n samples
            scheduler.add(
                Sequence(
                    request_id=f"dry-{i}-{j}",
                    prompt_token_ids=list(ids),
                    params=params,
                    seed=i,
                    index=j,
                    max_tokens=max_tokens,
                )
            )
    token = next(t for t in range(len(stops) + 1) if t not in stops)  # ends no request
    steps: list[tuple[ScheduledBatch, HostBatch]] = []

    def launch(launched: Launched, prev: Launched | None) -> None:
        hb = build_host_batch(
            launched.batch,
            page_size=scheduler.page_size,
            buckets=buckets,
            eos_token_ids=scheduler.eos_token_ids,
        )
        steps.append((launched.batch, hb))

    def complete(done: Launched, times) -> list[Sequence]:
        return scheduler.postprocess(
            done.batch, [token if s else None for s in done.batch.do_sample]
        )

    loop = StepLoop(scheduler, launch, complete, async_scheduling=async_scheduling)
    while loop.has_unfinished():
        loop.step()
    return steps
