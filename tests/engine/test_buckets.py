"""Shape buckets (host side): bucket lookup and the default decode batch buckets."""

import pytest

from jaxinfer.step_input import bucket, powers_of_two
from jaxinfer.step_input import default_batch_buckets as batch_buckets


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
    # above 64, a padded batch wastes less than one step: max(16, max_num_seqs // 16) rows
    step = max(16, max_num_seqs // 16)
    for n in range(65, max_num_seqs + 1):
        assert bucket(n, bs) - n < step


def test_256_seqs_pad_to_multiples_of_16_above_64():
    assert batch_buckets(256) == (
        1,
        2,
        4,
        8,
        16,
        32,
        64,
        80,
        96,
        112,
        128,
        144,
        160,
        176,
        192,
        208,
        224,
        240,
        256,
    )


def test_default_batch_buckets_reject_a_non_positive_limit():
    for bad in (0, -5, 2.5):
        with pytest.raises(ValueError, match="max_num_seqs=.* must be a positive integer"):
            batch_buckets(bad)


def test_covers_needs_the_same_features_and_no_smaller_sizes():
    from jaxinfer.step_input import ShapeKey, covers

    b = ShapeKey(batch=4, tokens=64, pages=8, penalty=0, query=32, all_greedy=True)
    assert covers(b, b)
    assert covers(b._replace(batch=8, tokens=128, pages=16, query=64, all_greedy=False), b)
    for bigger_but in (dict(batch=2), dict(tokens=32), dict(pages=4), dict(query=16)):
        assert not covers(
            b._replace(**dict(dict(batch=8, tokens=128, pages=16, query=64), **bigger_but)), b
        )
    assert not covers(b, b._replace(all_greedy=False))  # argmax only cannot sample
    for feature in (dict(penalty=16), dict(logprobs=1), dict(bias=8), dict(bitmask=4)):
        assert not covers(b._replace(**feature), b) and not covers(b, b._replace(**feature))
    decode = ShapeKey(batch=4, tokens=1, pages=8, penalty=0, query=None, all_greedy=True)
    assert not covers(b, decode) and not covers(decode._replace(batch=64), b)


def test_covering_keys_cover_every_plain_step_a_workload_visits():
    """Every sampling step without optional features that a dry run of a random workload visits
    is covered by `BucketSpec.covering_keys` (a packed one unless its [B, Q] rows pass 8 Tp)."""
    import random

    from jaxinfer.engine.block_manager import BlockManager
    from jaxinfer.engine.dry_run import dry_run
    from jaxinfer.engine.scheduler import Scheduler
    from jaxinfer.sampling_params import SamplingParams
    from jaxinfer.step_input import BucketSpec, covers

    rng = random.Random(0)
    spec = BucketSpec.build(
        max_num_seqs=8, max_num_batched_tokens=128, max_model_len=256, page_size=16
    )
    cover = spec.covering_keys()
    sched = Scheduler(
        BlockManager(200, 16),
        max_num_seqs=8,
        max_num_batched_tokens=128,
        max_model_len=256,
        page_size=16,
    )
    reqs = [
        (
            [rng.randrange(1, 100) for _ in range(rng.randrange(1, 200))],
            SamplingParams(
                temperature=rng.choice([0.0, 1.0]), max_tokens=rng.randrange(1, 40), ignore_eos=True
            ),
        )
        for _ in range(60)
    ]
    keys = {hb.key for _, hb in dry_run(sched, reqs, buckets=spec)}
    assert len(keys) > 3 * len(cover)
    capped = {k for k in keys if k.packed and k.batch * k.query > 8 * spec.packed_tokens[-1]}
    assert all(any(covers(c, k) for c in cover) for k in keys - capped)
