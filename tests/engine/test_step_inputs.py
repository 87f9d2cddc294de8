"""One host-to-device transfer per program of a step: step_input.pack (host, numpy) and
step.unpack (device, jnp) are inverses, bit for bit, for ragged and decode batches and each of
the forward, sampler and prompt-scorer buffers; the schema is the one layout."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer import step_input
from jaxinfer.engine.batch_builder import build_host_batch
from jaxinfer.engine.block_manager import BlockManager
from jaxinfer.engine.scheduler import Scheduler
from jaxinfer.engine.sequence import Sequence
from jaxinfer.runner.step import unpack
from jaxinfer.sampling_params import SamplingParams
from jaxinfer.step_input import BucketSpec

PAGE = 4


def _host_batches():
    """A packed prefill batch of three prompts with mixed sampling settings, then the decode
    batch after it."""
    sched = Scheduler(
        BlockManager(64, PAGE),
        max_num_seqs=4,
        max_num_batched_tokens=64,
        max_model_len=64,
        page_size=PAGE,
    )
    params = [
        SamplingParams(temperature=0.0, max_tokens=4, prompt_logprobs=2),
        SamplingParams(
            temperature=0.7,
            top_k=5,
            top_p=0.9,
            min_p=0.05,
            max_tokens=4,
            logit_bias={3: 1.5, 7: -2.0},
            logprobs=3,
            min_tokens=2,
        ),
        SamplingParams(
            temperature=1.3,
            repetition_penalty=1.2,
            presence_penalty=0.5,
            frequency_penalty=-0.25,
            max_tokens=4,
        ),
    ]
    seeds = [1, 2**32 - 5, 2**31 + 7]  # uint32 seeds with the top bit set survive the bit-cast
    for i, (n, p) in enumerate(zip([5, 13, 9], params)):
        sched.add(
            Sequence(
                request_id=str(i),
                prompt_token_ids=[(3 * i + j) % 250 + 1 for j in range(n)],
                params=p,
                seed=seeds[i],
            )
        )
    buckets = BucketSpec.build(
        max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64, page_size=PAGE, vocab_size=99
    )
    prefill = sched.schedule()
    hbs = [build_host_batch(prefill, page_size=PAGE, buckets=buckets)]
    sched.postprocess(prefill, [7, 8, 9])
    hbs.append(build_host_batch(sched.schedule(), page_size=PAGE, buckets=buckets))
    return hbs


@pytest.mark.parametrize("which", [0, 1], ids=["ragged_prefill", "decode"])
def test_unpack_inverts_pack(which):
    hb = _host_batches()[which]
    assert hb.shape.forward.decode == (which == 1)
    src = np.arange(hb.rows, dtype=np.int32) - 2
    hb.pending_src[:] = src
    hash(hb.shape)  # static jit arguments
    got = {}
    for group in ("forward", "sampling", "prompt"):
        buf = step_input.pack(hb, group)
        assert buf.dtype == np.int32 and buf.ndim == 1
        fn = jax.jit(unpack, static_argnums=(1, 2, 3))
        got.update(fn(jnp.asarray(buf), group, hb.shape, hb.sizes))
    want = dict(hb.arrays)
    assert set(want) == {
        f.name
        for g in ("forward", "sampling", "prompt")
        for f, _ in step_input.layout(g, hb.shape, hb.sizes)
    }
    assert set(got) == set(want)
    for name, a in want.items():
        g = np.asarray(got[name])
        assert g.dtype == a.dtype and g.shape == a.shape, name
        np.testing.assert_array_equal(g.view(np.int32), a.view(np.int32), err_msg=name)
    assert (hb.seeds > 2**31).any() and (hb.temperature > 0).any()
    assert hb.shape.sampler.level == "full" and hb.shape.sampler.bias == 128  # the full level
    assert bool(hb.shape.prompt) == (which == 0)  # prompt positions in the prefill only
    if which == 0:  # rows back to back: row r starts where row r - 1 ends
        qsl = hb.query_start_loc
        assert list(qsl[:4]) == [0, 5, 18, 27] and (qsl[4:] == 27).all()
        assert list(hb.logits_indices[:3]) == [4, 17, 26]


def test_pack_rejects_non_four_byte_fields():
    hb = _host_batches()[1]
    bad = hb.__class__(
        hb.shape,
        hb.sizes,
        {**hb.arrays, "seq_lens": hb.seq_lens.astype(np.int64)},
        hb.sample_rows,
        hb.pending_rows,
    )
    with pytest.raises(TypeError, match="seq_lens"):
        step_input.pack(bad, "forward")


def test_empty_batch_matches_the_shape_and_pads():
    """The ahead-of-time batch has the layout of a real batch of the same shape, all padding."""
    for hb in _host_batches():
        empty = step_input.allocate(hb.shape, hb.sizes)
        assert empty.shape == hb.shape
        for group in ("forward", "sampling", "prompt"):
            assert step_input.pack(empty, group).shape == step_input.pack(hb, group).shape
        assert (empty.seq_lens == 0).all() and (empty.block_tables == 0).all()
        assert (empty.pending_src == -1).all() and not empty.sample_rows.any()


def test_token_ids_slices_prompt_and_outputs():
    """`Sequence.token_ids` (the builder's token reads) is ``all_token_ids`` sliced."""
    s = Sequence(
        request_id="a",
        prompt_token_ids=[1, 2, 3],
        params=SamplingParams(max_tokens=4),
        seed=0,
        output_token_ids=[4, 5],
    )
    for lo in range(7):
        for hi in range(lo, 8):
            assert s.token_ids(lo, hi) == s.all_token_ids[lo:hi], (lo, hi)
