"""Shape buckets (host side): bucket lookup and the default decode batch buckets."""

import pytest

from jaxinfer.step_input import bucket, default_batch_buckets as batch_buckets, powers_of_two


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
        [max_num_seqs] if max_num_seqs < 64 and max_num_seqs & (max_num_seqs - 1) else [])
    # above 64, a padded batch wastes less than one step: max(16, max_num_seqs // 16) rows
    step = max(16, max_num_seqs // 16)
    for n in range(65, max_num_seqs + 1):
        assert bucket(n, bs) - n < step


def test_256_seqs_pad_to_multiples_of_16_above_64():
    assert batch_buckets(256) == (1, 2, 4, 8, 16, 32, 64, 80, 96, 112, 128, 144, 160, 176, 192,
                                  208, 224, 240, 256)


def test_default_batch_buckets_reject_a_non_positive_limit():
    for bad in (0, -5, 2.5):
        with pytest.raises(ValueError, match="max_num_seqs=.* must be a positive integer"):
            batch_buckets(bad)
