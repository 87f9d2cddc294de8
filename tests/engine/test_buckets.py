"""Shape buckets (host side): bucket lookup, the default row and token buckets, the planned
set of step programs."""

import pytest

from jaxinfer.step_input import BucketSpec, Sizes, bucket, powers_of_two
from jaxinfer.step_input import default_batch_buckets as batch_buckets
from jaxinfer.step_input import default_token_buckets as token_buckets


def test_bucket_is_the_smallest_that_fits():
    bs = powers_of_two(16, 100)
    assert bs == (16, 32, 64, 100)
    assert [bucket(n, bs) for n in (1, 16, 17, 64, 65, 100)] == [16, 16, 32, 64, 100, 100]
    with pytest.raises(ValueError, match="exceeds the largest bucket 100"):
        bucket(101, bs)


@pytest.mark.parametrize("max_num_seqs", [1, 3, 8, 64, 65, 100, 256, 1000, 1024])
def test_default_batch_buckets(max_num_seqs):
    bs = batch_buckets(max_num_seqs)
    assert list(bs) == sorted(set(bs)) and bs[0] == 1 and bs[-1] == max_num_seqs
    small = [b for b in bs if b <= 64]
    assert small == [b for b in (1, 2, 4, 8, 16, 32, 64) if b <= max_num_seqs] + (
        [max_num_seqs] if max_num_seqs < 64 and max_num_seqs & (max_num_seqs - 1) else []
    )
    # above 64, a padded batch wastes at most a third of its rows
    for n in range(65, max_num_seqs + 1):
        assert bucket(n, bs) - n <= bucket(n, bs) // 3


def test_256_seqs_and_8192_tokens_give_at_most_24_forward_shapes():
    """The bench's configuration (256 rows, 8,192-token budget, 2,048 context): the whole
    planned set of forwards is bounded (issue 44 item 6), each sampler row count has every
    level, and nothing depends on a sampling feature."""
    spec = BucketSpec.build(
        max_num_seqs=256,
        max_num_batched_tokens=8192,
        max_model_len=2048,
        page_size=16,
        vocab_size=151936,
    )
    assert spec.batch == (1, 2, 4, 8, 16, 32, 64, 96, 128, 192, 256)
    assert spec.tokens == (32, 64, 128, 256, 512, 1024, 1536, 2048, 3072, 4096, 6144, 8192)
    planned = spec.planned()
    assert len(planned["forward"]) == 23 <= 24
    assert {k.decode for k in planned["forward"]} == {True, False}
    rows = spec.sampler_rows()
    assert len(planned["sampler"]) == 3 * len(rows) and rows[-1] == 256
    assert spec.sizes == Sizes(pages=128, history=2048, mask_words=4748, max_rows=256)


def test_default_token_buckets():
    assert token_buckets(128) == (32, 64, 128)
    assert token_buckets(10) == (32,)
    assert token_buckets(2048) == (32, 64, 128, 256, 512, 1024, 1536, 2048)


def test_default_batch_buckets_reject_a_non_positive_limit():
    for bad in (0, -5, 2.5):
        with pytest.raises(ValueError, match="max_num_seqs=.* must be a positive integer"):
            batch_buckets(bad)


def test_step_shapes_of_a_random_workload_are_planned():
    """Every step a dry run of a random workload visits has a planned forward, and a planned
    sampler (no processors, bias within the first bucket)."""
    import random

    from jaxinfer.engine.block_manager import BlockManager
    from jaxinfer.engine.dry_run import dry_run
    from jaxinfer.engine.scheduler import Scheduler
    from jaxinfer.sampling_params import SamplingParams

    rng = random.Random(0)
    spec = BucketSpec.build(
        max_num_seqs=8, max_num_batched_tokens=128, max_model_len=256, page_size=16, vocab_size=99
    )
    sched = Scheduler(
        BlockManager(200, 16),
        max_num_seqs=8,
        max_num_batched_tokens=128,
        max_model_len=256,
        page_size=16,
    )
    features = [{}, dict(logprobs=2), dict(presence_penalty=0.5), dict(min_tokens=3)]
    reqs = [
        (
            [rng.randrange(1, 99) for _ in range(rng.randrange(1, 200))],
            SamplingParams(
                temperature=rng.choice([0.0, 1.0]),
                max_tokens=rng.randrange(4, 40),
                ignore_eos=True,
                **rng.choice(features),
            ),
        )
        for _ in range(60)
    ]
    shapes = {hb.shape for _, hb in dry_run(sched, reqs, buckets=spec)}
    planned = spec.planned()
    assert {s.forward for s in shapes} <= set(planned["forward"])
    assert {s.sampler for s in shapes} <= set(planned["sampler"])
    assert {s.forward.decode for s in shapes} == {True, False}
    assert {"sample", "full"} <= {s.sampler.level for s in shapes}
