"""Presence/frequency penalties, min_tokens, logit_bias and log-probabilities: the device
functions (`jaxinfer.runner.sampling`) against plain-numpy reimplementations of vLLM's definitions
(``v1/sample/sampler.py``, ``ops/penalties.py``, ``MinTokensLogitsProcessor``,
``LogitBiasLogitsProcessor``, ``gather_logprobs``); the host side (`build_host_batch` entries,
`jaxinfer.engine.logprobs.record`, the synchronous step) on plain sequences."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.engine import logprobs as host_logprobs
from jaxinfer.engine.batch_builder import build_host_batch
from jaxinfer.engine.block_manager import BlockManager
from jaxinfer.engine.loop import StepLoop
from jaxinfer.engine.scheduled_batch import ScheduledBatch
from jaxinfer.engine.scheduler import Scheduler
from jaxinfer.engine.sequence import Sequence
from jaxinfer.runner.sampling import SamplingMetadata, logprobs, sample
from jaxinfer.sampling_params import SamplingParams
from jaxinfer.step_input import BucketSpec
from tests.test_sampling import filtered_logits

V, PAGE, EOS = 64, 4, 2


def np_vllm(logits, prompt, output, p: SamplingParams, eos=(EOS,)):
    """vLLM's processed logits (before temperature), float64: min_tokens -> -inf at EOS and
    stop_token_ids; logit_bias added; repetition penalty over prompt + output ids; minus
    frequency x output count and presence x [output count > 0]."""
    x = np.asarray(logits, np.float64).copy()
    if len(output) < p.min_tokens:
        x[list({*eos, *p.stop_token_ids})] = -np.inf
    for t, b in (p.logit_bias or {}).items():
        x[t] += b
    seen = np.zeros(len(x), bool)
    seen[list(prompt) + list(output)] = True
    r = p.repetition_penalty
    x = np.where(seen, np.where(x > 0, x / r, x * r), x)
    counts = np.bincount(np.asarray(output, np.int64), minlength=len(x))
    return x - p.frequency_penalty * counts - p.presence_penalty * (counts > 0)


ROWS = [  # (prompt, output, params): mixed options, plain rows between penalised ones
    ([5, 6, 7], [9, 9, 11, 5], SamplingParams(presence_penalty=1.5, frequency_penalty=0.5)),
    ([1, 3], [3, 4], SamplingParams()),
    (
        [8, 8, 10],
        [10, 12, 12, 12],
        SamplingParams(frequency_penalty=-1.0, presence_penalty=-0.5, repetition_penalty=1.3),
    ),
    (
        [4],
        [20],
        SamplingParams(min_tokens=3, stop_token_ids=[30, 31], logit_bias={7: 3.0, 8: -100}),
    ),
    ([4], [20, 21, 22], SamplingParams(min_tokens=3, stop_token_ids=[30], logit_bias={0: 2.5})),
    ([13, 14], [], SamplingParams(min_tokens=1, ignore_eos=True)),
]


def _decode_batch(rows=ROWS, eos=(EOS,)):
    """(`ScheduledBatch`, `HostBatch` from the engine's batch builder) of one step computing
    the last token of each row's history (prompt + output) and sampling the next."""
    seqs = []
    for i, (prompt, out, p) in enumerate(rows):
        s = Sequence(str(i), prompt, p, seed=i, output_token_ids=out)
        s.block_table = list(range(1 + 8 * i, 1 + 8 * i + -(-s.num_tokens // PAGE)))
        s.num_computed_tokens, s.num_pending_tokens = s.num_tokens - 1, 1  # as schedule() leaves
        seqs.append(s)
    batch = ScheduledBatch(seqs, [1] * len(seqs))
    buckets = BucketSpec.build(
        max_num_seqs=8, max_num_batched_tokens=64, max_model_len=32, page_size=PAGE, vocab_size=V
    )
    return batch, build_host_batch(batch, page_size=PAGE, buckets=buckets, eos_token_ids=eos)


def _meta(hb) -> SamplingMetadata:
    names = [f for f in SamplingMetadata.__dataclass_fields__ if f in hb.arrays]
    return SamplingMetadata(**{f: jnp.asarray(hb.arrays[f]) for f in names})


def _logits(b, seed=0):
    return np.random.default_rng(seed).normal(0, 2, (b, V)).astype(np.float32)


def test_builder_entries_and_key():
    batch, hb = _decode_batch()
    assert [len(s.output_token_ids) for s in batch.seqs][:5] == [4, 2, 4, 1, 3]
    assert hb.shape.sampler.level == "full" and hb.shape.sampler.bias == 128
    entries = lambda i: {
        (int(t), float(v)) for t, v in zip(hb.bias_ids[i], hb.bias_values[i]) if t >= 0
    }
    assert entries(3) == {(7, 3.0), (8, -100.0), (EOS, -np.inf), (30, -np.inf), (31, -np.inf)}
    assert entries(4) == {(0, 2.5)}  # 3 outputs: min_tokens reached
    assert entries(5) == {(EOS, -np.inf)}  # EOS masked even with ignore_eos (vLLM)
    assert entries(1) == set()
    # only rows whose penalties read the history carry it
    np.testing.assert_array_equal(hb.prompt_lens[:6], [3, 0, 3, 0, 0, 0])
    assert (hb.penalty_tokens[1] == -1).all() and list(hb.penalty_tokens[0, :7]) == [
        5,
        6,
        7,
        9,
        9,
        11,
        5,
    ]
    np.testing.assert_allclose(hb.presence_penalty[:3], [1.5, 0.0, -0.5])
    # a batch asking nothing pays nothing: no penalty history, no bias, no logprob outputs
    plain = [(pr, out, SamplingParams()) for pr, out, _ in ROWS]
    shape = _decode_batch(plain)[1].shape
    assert shape.sampler.level == "sample" and shape.sampler.bias == 0 and not shape.prompt
    assert "penalty_tokens" not in _decode_batch(plain)[1].arrays


def test_processed_logits_match_numpy_vllm():
    """filtered_logits at temperature 1 with no filter is the processed logits minus their
    max; greedy `sample` is their argmax; each row equals the numpy reference."""
    batch, hb = _decode_batch()
    meta, x = _meta(hb), _logits(hb.rows)
    got = np.asarray(jax.jit(filtered_logits)(jnp.asarray(x), meta))
    greedy = np.asarray(
        jax.jit(sample, static_argnames="all_greedy")(
            jnp.asarray(x),
            meta.replace(temperature=jnp.zeros_like(meta.temperature)),
            all_greedy=True,
        )
    )
    for i, s in enumerate(batch.seqs):
        want = np_vllm(x[i], s.prompt_token_ids, s.output_token_ids, s.params)
        finite = np.isfinite(want)
        np.testing.assert_array_equal(np.isfinite(got[i]), finite)
        np.testing.assert_allclose(got[i][finite], (want - want.max())[finite], atol=1e-5)
        assert greedy[i] == np.argmax(want)


def test_penalised_rows_never_change_a_neighbour():
    """Each row's sampled token (seeded, temperature 1) and processed logits are the same alone
    and beside the penalised rows."""
    batch, hb = _decode_batch()
    meta, x = _meta(hb), _logits(hb.rows, 1)
    # jitted as in the engine's step, so that each row alone is one compile, not one per op
    filt, samp = jax.jit(filtered_logits), jax.jit(sample, static_argnames="all_greedy")
    both = np.asarray(filt(jnp.asarray(x), meta))
    toks = np.asarray(samp(jnp.asarray(x), meta, all_greedy=False))
    for i in range(len(ROWS)):
        one = jax.tree_util.tree_map(lambda a, i=i: a[i : i + 1], meta)
        alone = np.asarray(filt(jnp.asarray(x[i : i + 1]), one))[0]
        np.testing.assert_array_equal(alone, both[i])
        assert int(samp(jnp.asarray(x[i : i + 1]), one, all_greedy=False)[0]) == toks[i]
    plain = [(pr, out, SamplingParams()) for pr, out, _ in ROWS]
    meta0 = _meta(_decode_batch(plain)[1])
    np.testing.assert_array_equal(np.asarray(filt(jnp.asarray(x), meta0))[1], both[1])


def test_logprobs_match_numpy():
    """Raw log_softmax: the chosen token's logprob, its rank (vLLM: ids at least as likely) and
    the top k, descending."""
    x = _logits(4, 2)
    x[1, 3] = x[1, 7] = x[1].max() + 1.0  # a tie at the top
    tokens = np.array([0, 7, 63, 5], np.int32)
    got = jax.jit(logprobs, static_argnums=2)(jnp.asarray(x), jnp.asarray(tokens), 5)
    ref = np.asarray(x, np.float64)
    ref = ref - ref.max(-1, keepdims=True)
    ref = ref - np.log(np.exp(ref).sum(-1, keepdims=True))
    for b, t in enumerate(tokens):
        assert abs(float(got["logprobs"][b]) - ref[b, t]) < 1e-5
        assert int(got["ranks"][b]) == (ref[b] >= ref[b, t] - 1e-9).sum()
        np.testing.assert_allclose(
            np.asarray(got["top_logprobs"][b]), np.sort(ref[b])[::-1][:5], atol=1e-5
        )
        np.testing.assert_allclose(
            ref[b, np.asarray(got["top_ids"][b])], np.sort(ref[b])[::-1][:5], atol=1e-5
        )
    assert int(got["ranks"][1]) == 2  # vLLM counts the tie


def test_record_orders_prompt_positions_and_sampled_tokens():
    """Chunked prompt positions arrive in order (first entry None); positions already recorded
    (recompute) are skipped; a sampled record holds the chosen token and the top k."""
    p = SamplingParams(logprobs=1, prompt_logprobs=1)
    s = Sequence("a", [1, 2, 3, 4], p, seed=0)

    class HB:  # two positions of a packed row: positions 0 and 1 scored
        positions = np.array([[0, 1, 0, 0]], np.int32)
        prompt_lp_index = np.array([0, 1, 0], np.int32)
        prompt_lp_next = np.array([2, 3, -1], np.int32)
        prompt_lp_rows = np.array([0, 0, -1], np.int32)

    out = dict(
        logprobs=np.array([-0.5]),
        ranks=np.array([2]),
        top_ids=np.array([[9, 4]]),
        top_logprobs=np.array([[-0.1, -0.5]]),
        prompt_logprobs=np.array([-1.0, -2.0, 0]),
        prompt_ranks=np.array([3, 1, 0]),
        prompt_top_ids=np.array([[7, 0], [3, 0], [0, 0]]),
        prompt_top_logprobs=np.array([[-0.2, -3], [-2.0, -3], [0, 0]]),
    )
    s.output_token_ids.append(4)
    host_logprobs.record(out, HB, [s], [0])
    host_logprobs.record(out, HB, [s], [1])  # the same positions again: skipped; no new token
    assert s.prompt_logprobs == [None, {2: (-1.0, 3), 7: (-0.2, 1)}, {3: (-2.0, 1)}]
    assert s.logprobs == [{4: (-0.5, 2), 9: (-0.1, 1)}] and s.cumulative_logprob == -0.5


def test_history_penalties_make_the_step_synchronous():
    """A batch with a presence/frequency penalty row is read back before the next schedule (its
    history must be complete); without one, the next step overlaps."""
    for p, sync in (
        (SamplingParams(max_tokens=4, presence_penalty=0.5), True),
        (SamplingParams(max_tokens=4, frequency_penalty=-0.1), True),
        (SamplingParams(max_tokens=4, min_tokens=2, logit_bias={1: 1.0}), False),
    ):
        sched = Scheduler(
            BlockManager(16, PAGE),
            max_num_seqs=2,
            max_num_batched_tokens=16,
            max_model_len=16,
            page_size=PAGE,
        )
        sched.add(Sequence("a", [1, 2], p, seed=0))
        loop = StepLoop(
            sched,
            lambda b, prev: None,
            lambda d, t, sched=sched: sched.postprocess(d.batch, [7] * d.batch.num_seqs),
        )
        loop.step()
        assert loop.in_flight.sync is sync


def test_logit_bias_outside_the_vocabulary_is_rejected():
    import jax
    import jax.numpy as jnp

    from jaxinfer import LLM, models
    from jaxinfer.config import ModelConfig

    cfg = ModelConfig("llama", 64, 16, 32, 1, 2, 1, 8)
    llm = LLM.from_params(
        cfg,
        models.init_params(cfg, jax.random.key(0), jnp.float32),
        max_model_len=32,
        num_pages=8,
        page_size=8,
        max_num_seqs=2,
    )
    with pytest.raises(ValueError, match=r"logit_bias has token id 64, out of range.*\[0, 64\)"):
        llm.generate([[1, 2]], SamplingParams(logit_bias={64: 1.0}))
    with pytest.raises(ValueError, match="logit_bias"):
        llm.engine.add_request([1, 2], SamplingParams(logit_bias={"99": 1.0}))
