"""Speculative decoding (n-gram drafts) on the tiny random model: greedy output equals plain
decoding's token for token (with log-probabilities, n > 1, max_tokens edges, preemption,
prefix caching and stop strings), sampled output has plain decoding's distribution
(chi-square), and speculation turns off above ``disable_by_batch_size``."""

import dataclasses
import json

import numpy as np
import pytest
from scipy import stats
from script_module import load_script
from tiny_model import TINY_ENGINE, tiny_params_of

from jaxinfer import SamplingParams

NGRAM = dict(method="ngram", num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=3)
SPEC = json.dumps(NGRAM)  # hashable: tiny_llm keys engines by their arguments
# repetitive prompts: the n-gram proposer finds matches and the tiny model accepts some
PROMPTS = [{"prompt_token_ids": ([5, 6, 7, 8, 9, 10] * 8)[: 20 + 3 * i]} for i in range(5)]
ALPHA = 0.001  # significance of the distribution test


def _tokens(outs) -> list[list[list[int]]]:
    return [[c.token_ids for c in o.outputs] for o in outs]


@pytest.fixture(scope="module")
def pair(tiny_llm):
    """(plain, speculative) tiny engines over the same weights, no tokenizer."""
    return tiny_llm(text=False), tiny_llm(text=False, speculative_config=SPEC)


def test_greedy_equals_plain_decoding(pair):
    """Mixed rows: a log-probability row (never given drafts), n = 2, others speculating."""
    plain, spec = pair
    before = spec.engine.stats().spec_num_accepted_tokens
    sps = [
        SamplingParams(
            max_tokens=30,
            temperature=0.0,
            ignore_eos=True,
            logprobs=2 if i == 1 else None,
            n=2 if i == 2 else 1,
        )
        for i in range(len(PROMPTS))
    ]
    want, got = plain.generate(PROMPTS, sps), spec.generate(PROMPTS, sps)
    assert _tokens(got) == _tokens(want)
    got_lp, want_lp = got[1].outputs[0].logprobs, want[1].outputs[0].logprobs
    assert [{t: lp.rank for t, lp in d.items()} for d in got_lp] == [
        {t: lp.rank for t, lp in d.items()} for d in want_lp
    ]
    flat = [[lp.logprob for lp in d.values()] for d in (*got_lp, *want_lp)]
    n = len(got_lp)  # other batch compositions: float32 rounding apart
    np.testing.assert_allclose(np.array(flat[:n]), np.array(flat[n:]), rtol=1e-5, atol=1e-5)
    st = spec.engine.stats()
    assert st.spec_num_accepted_tokens > before and st.spec_num_drafts > 0
    assert st.spec_num_accepted_tokens <= st.spec_num_draft_tokens
    assert sum(st.spec_accepted_per_pos) == st.spec_num_accepted_tokens


def test_verify_samplers_lower_ahead_of_time(pair):
    """`LLM.precompile()`'s verify samplers (every level, k + 1 logits rows per row) lower on
    their ahead-of-time arguments (`StepExecutor._avals`)."""
    runner = pair[1].engine.runner
    ex = runner.executor
    keys = [k for k in runner.buckets.planned()["sampler"] if k.spec][:3]
    assert {k.level for k in keys} == {"greedy", "sample", "full"}
    for key in keys:
        ex._lower("sampler", key, ex._avals("sampler", key, runner.params, runner.kv))


def test_token_by_token_attention_equals_plain(pair, tiny_llm):
    """Verify steps of at most 32 tokens attended token by token (`layers.by_token`) give plain
    decoding's greedy tokens."""
    plain, _ = pair
    kernels = TINY_ENGINE["kernels"] + ",ragged_decode_max_tokens=32"
    spec = tiny_llm(text=False, speculative_config=SPEC, kernels=kernels)
    assert spec.engine.resolved.kernels.ragged_decode_max_tokens == 32
    sp = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    assert _tokens(spec.generate(PROMPTS, sp)) == _tokens(plain.generate(PROMPTS, sp))
    assert spec.engine.stats().spec_num_accepted_tokens > 0


@pytest.mark.parametrize("max_tokens", [1, 2, 3, 4, 7])
def test_max_tokens_edges(pair, max_tokens):
    """Drafts are cut so a row never emits past max_tokens."""
    plain, spec = pair
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    got = _tokens(spec.generate(PROMPTS, sp))
    assert got == _tokens(plain.generate(PROMPTS, sp))
    assert all(len(t) == max_tokens for o in got for t in o)


def test_preemption_and_prefix_caching(tiny_llm, monkeypatch):
    """A pool too small for every row at once (preemption, recompute) and shared prompt pages
    (prefix caching): the same tokens as plain decoding under the same pool."""
    args = dict(text=False, num_pages=14, enable_prefix_caching=True)
    plain, spec = tiny_llm(**args), tiny_llm(**args, speculative_config=SPEC)
    prompts = [{"prompt_token_ids": PROMPTS[0]["prompt_token_ids"] + [i]} for i in range(6)]
    sp = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    want = plain.generate(prompts, sp)
    sched, victims = spec.engine.scheduler, []
    preempt = sched._preempt
    monkeypatch.setattr(sched, "_preempt", lambda s: victims.append(s) or preempt(s))
    got = spec.generate(prompts, sp)
    assert victims, "the pool should force a preemption"
    assert _tokens(got) == _tokens(want)
    assert sum(o.num_cached_tokens or 0 for o in got) > 0
    assert spec.engine.stats().spec_num_accepted_tokens > 0


def test_stop_string_cuts_inside_accepted_drafts(tiny_llm):
    """A stop string completed by an accepted draft ends the output there, as plain decoding."""
    plain, spec = tiny_llm(seed=1), tiny_llm(seed=1, speculative_config=SPEC)  # own engines
    prompt = "abcabcabcabcabcabcabc"
    sp = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    text = plain.generate([prompt], sp)[0].outputs[0].text
    stop = text[12:14]
    sp = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, stop=[stop])
    want, got = (
        plain.generate([prompt], sp)[0].outputs[0],
        spec.generate([prompt], sp)[0].outputs[0],
    )
    assert (got.text, got.token_ids, got.finish_reason) == (
        want.text,
        want.token_ids,
        want.finish_reason,
    )
    assert got.finish_reason == "stop"


def test_sampled_distribution_equals_plain(pair):
    """Chi-square homogeneity (significance `ALPHA`) of the output tokens 2 to 4 of 400 seeded
    requests, plain against speculative: rejection sampling keeps the distribution."""
    plain, spec = pair
    before = spec.engine.stats().spec_num_accepted_tokens
    prompts = [PROMPTS[0]] * 400
    sps = [
        SamplingParams(max_tokens=4, temperature=1.0, seed=i, ignore_eos=True)
        for i in range(len(prompts))
    ]
    a = np.array(_tokens(plain.generate(prompts, sps)))[:, 0, 1:]
    # 8 at a time: a longer queue turns speculation off (admission first)
    b = [_tokens(spec.generate(prompts[i : i + 8], sps[i : i + 8])) for i in range(0, 400, 8)]
    b = np.array([t for part in b for t in part])[:, 0, 1:]
    assert spec.engine.stats().spec_num_accepted_tokens > before
    for j in range(a.shape[1]):
        ids = np.union1d(a[:, j], b[:, j])
        table = np.array([[np.sum(x[:, j] == t) for t in ids] for x in (a, b)])
        common = table.sum(0) >= 10  # rare tokens pooled into one column
        table = np.c_[table[:, common], table[:, ~common].sum(1)]
        table = table[:, table.sum(0) > 0]
        p = stats.chi2_contingency(table).pvalue if table.shape[1] > 1 else 1.0
        assert p > ALPHA, f"output token {j + 1}: p = {p:.2e}\n{table}"


def test_auto_off_above_disable_by_batch_size(tiny_llm):
    """disable_by_batch_size=1: steps with 3 decode rows (prefilled in one step, ending
    together) carry no drafts; alone, a row does."""
    spec = tiny_llm(text=False, speculative_config=json.dumps(NGRAM | {"disable_by_batch_size": 1}))
    sp = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    spec.generate(PROMPTS[:3], sp)
    assert spec.engine.stats().spec_num_drafts == 0
    spec.generate(PROMPTS[:1], sp)
    assert spec.engine.stats().spec_num_drafts > 0


@pytest.fixture(scope="module")
def drafts(tiny_cfg, tiny_params, tmp_path_factory) -> dict:
    """Draft checkpoints (Orbax) of `TINY`'s vocabulary: "same" (the target's own weights: every
    draft accepted) and "other" (one smaller random layer: few accepted)."""
    save, root = load_script("convert_checkpoint").save_checkpoint, tmp_path_factory.mktemp("d")
    small = dataclasses.replace(tiny_cfg, num_layers=1, hidden_size=32, intermediate_size=48)
    save(root / "same", tiny_cfg, tiny_params, None, ())
    save(root / "other", small, tiny_params_of(small, 5), None, ())
    return {k: str(root / k) for k in ("same", "other")}


@pytest.mark.parametrize("which", ["same", "other"])
def test_draft_model_greedy_equals_plain(tiny_llm, drafts, which):
    """The draft model's drafts, verified: plain decoding's tokens, n = 2 and a logprobs row
    included; the target's own weights as the draft have every draft accepted."""
    plain = tiny_llm(text=False)
    cfg = dict(method="draft_model", model=drafts[which], num_speculative_tokens=3)
    spec = tiny_llm(text=False, speculative_config=json.dumps(cfg))
    sps = [
        SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, n=2 if i == 2 else 1)
        for i in range(len(PROMPTS))
    ]
    assert _tokens(spec.generate(PROMPTS, sps)) == _tokens(plain.generate(PROMPTS, sps))
    st = spec.engine.stats()
    assert st.spec_num_draft_tokens > 0
    if which == "same":
        assert st.spec_num_accepted_tokens == st.spec_num_draft_tokens


def test_draft_model_vocabulary_must_match(tiny_llm, tiny_cfg, tmp_path):
    """A draft of another vocabulary is refused when the engine starts, naming both sizes, and
    one that cannot be read with the reader's error; both name speculative_config's model."""
    from jaxinfer import LLM

    other = dataclasses.replace(tiny_cfg, vocab_size=128, num_layers=1)
    load_script("convert_checkpoint").save_checkpoint(
        tmp_path / "d", other, tiny_params_of(other), None, ()
    )
    plain = tiny_llm(text=False)
    (tmp_path / "empty").mkdir()  # no checkpoint: the reader's error
    for method, path, match in (
        ("draft_model", "d", "model='.*d' .*vocab_size=128 .*vocab_size=256"),
        ("draft_model", "empty", r"model='.*empty' \(method 'draft_model'\) .*no.* config"),
        ("eagle3", "empty", r"model='.*empty' \(method 'eagle3'\) cannot be used: .*config"),
    ):
        cfg = dict(method=method, model=str(tmp_path / path), num_speculative_tokens=2)
        with pytest.raises(ValueError, match=match):
            LLM.from_params(
                plain.engine.model_config,
                plain.engine.runner.params,
                dtype="float32",
                num_pages=8,
                speculative_config=cfg,
            )


def test_speculation_turns_on_and_off_mid_run(pair, tiny_llm):
    """disable_by_batch_size=2 and rows ending at different lengths: steps go from plain to
    verify steps as the batch shrinks; the tokens stay plain decoding's."""
    plain = pair[0]
    spec = tiny_llm(text=False, speculative_config=json.dumps(NGRAM | {"disable_by_batch_size": 2}))
    sps = [
        SamplingParams(max_tokens=6 + 7 * i, temperature=0.0, ignore_eos=True)
        for i in range(len(PROMPTS))
    ]
    before = spec.engine.stats().spec_num_drafts
    assert _tokens(spec.generate(PROMPTS, sps)) == _tokens(plain.generate(PROMPTS, sps))
    assert spec.engine.stats().spec_num_drafts > before


def test_draft_model_sleep_and_wake_up(tiny_llm, drafts):
    """sleep(1) deletes the draft's pool with the target's; after wake_up the same tokens, every
    draft of the target's own weights accepted again."""
    cfg = dict(method="draft_model", model=drafts["same"], num_speculative_tokens=2)
    spec = tiny_llm(text=False, max_num_seqs=4, speculative_config=json.dumps(cfg))  # its own
    sp = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    want = _tokens(spec.generate(PROMPTS[:2], sp))
    spec.sleep(1)
    assert spec.engine.runner.draft.kv.k.is_deleted()
    spec.wake_up()
    assert _tokens(spec.generate(PROMPTS[:2], sp)) == want
    st = spec.engine.stats()
    assert st.spec_num_accepted_tokens == st.spec_num_draft_tokens > 0
