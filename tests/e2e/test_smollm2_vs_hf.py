"""Acceptance 1, 2, 4, 5 and CASES C4, C8: real SmolLM2 weights, jaxinfer vs HF transformers greedy;
the mechanics (preemption, ragged batches, stop strings, compile bounds) on the tiny model."""

import pytest

from jaxinfer import LLM, SamplingParams

from .conftest import PAGE_SIZE

GREEDY = dict(temperature=0.0)


# the prompts compared with HF: the plain and the code prompt, both chat prompts (the third plain
# prompt is one more short sentence: tests/e2e/conftest.py)
CHECKED = (0, 1, 3, 4)


@pytest.fixture(scope="module")
def singles(llm, prompt_ids):
    """{i: output} of each `CHECKED` prompt run alone (one request at a time), greedy, 32 new
    tokens: the runs the tests below check against HF and build on."""
    sp = SamplingParams(max_tokens=32, **GREEDY)
    return {i: llm.generate({"prompt_token_ids": prompt_ids[i]}, sp)[0] for i in CHECKED}


def test_each_prompt_matches_hf(singles, hf_greedy, prompt_ids):
    """Acceptance 1: greedy, 32 new tokens, token-identical to HF, one request at a time."""
    for i, out in singles.items():
        assert list(out.token_ids) == hf_greedy(prompt_ids[i], 32)


def test_france_answers_paris(singles):
    out = singles[3]
    assert "Paris" in out.text
    assert out.outputs[0].finish_reason == "stop"


def test_batch_of_mixed_lengths_matches_single(llm, hf_greedy, prompt_ids):
    """Acceptance 2: the same prompts as one ragged batch give the same tokens."""
    prompts = [prompt_ids[i] for i in CHECKED]
    outs = llm.generate(
        [{"prompt_token_ids": ids} for ids in prompts], SamplingParams(max_tokens=32, **GREEDY)
    )
    assert len({len(ids) for ids in prompts}) > 1  # really ragged
    for ids, out in zip(prompts, outs):
        assert list(out.token_ids) == hf_greedy(ids, 32)


BOUNDARY_LENGTHS = (PAGE_SIZE - 1, PAGE_SIZE, PAGE_SIZE + 1)


@pytest.fixture(scope="module")
def page_boundary_runs(llm):
    """{length: (prompt ids, output)}: the prompts of `test_page_boundaries`, generated in one
    batch (one engine run: each row crosses the page boundaries of its own pages)."""
    text = (
        "In the beginning of the twentieth century, the city grew quickly as new railways "
        "brought workers, merchants and families from the countryside."
    )
    prompts = [llm.get_tokenizer().encode(text)[:n] for n in BOUNDARY_LENGTHS]
    outs = llm.generate(
        [{"prompt_token_ids": ids} for ids in prompts],
        SamplingParams(max_tokens=3 * PAGE_SIZE, ignore_eos=True, **GREEDY),
    )
    return dict(zip(BOUNDARY_LENGTHS, zip(prompts, outs)))


@pytest.mark.parametrize("length", BOUNDARY_LENGTHS)
def test_page_boundaries(page_boundary_runs, hf_greedy, length):
    """Acceptance 4: prompts around one page, generation crossing several page boundaries."""
    ids, out = page_boundary_runs[length]
    assert len(ids) == length
    assert list(out.token_ids) == hf_greedy(ids, 3 * PAGE_SIZE, ignore_eos=True)
    assert out.outputs[0].finish_reason == "length"


def test_preemption_gives_same_outputs(tiny, tiny_prompt_ids):
    """Acceptance 5: a pool too small for all running sequences forces preemption by recompute."""
    sp = SamplingParams(max_tokens=40, ignore_eos=True, **GREEDY)
    prompts = [{"prompt_token_ids": ids} for ids in tiny_prompt_ids]
    expected = [list(o.token_ids) for o in tiny.generate(prompts, sp)]
    need = sum(-(-(len(ids) + 40) // PAGE_SIZE) for ids in tiny_prompt_ids)
    small = LLM.from_params(
        tiny.engine.model_config,
        tiny.engine.runner.params,
        max_model_len=512,
        max_num_seqs=8,
        page_size=PAGE_SIZE,
        num_pages=need // 2 + 1,
        dtype="float32",
    )  # the tiny LLM's weights, a small pool
    outs = small.generate(prompts, sp)
    assert [list(o.token_ids) for o in outs] == expected
    assert sum(o.metrics.num_preemptions for o in outs) > 0
    bm = small.engine.block_manager
    assert bm.num_free_pages == bm.num_usable_pages


def test_ignore_eos_and_eos_union(llm, hf_greedy, prompt_ids, singles):
    """CASES C4: ignore_eos -> exactly max_tokens, 'length'; else stop at the first EOS id,
    'stop'."""
    ids = prompt_ids[4]  # one-word answer
    on = llm.generate(
        {"prompt_token_ids": ids}, SamplingParams(max_tokens=32, ignore_eos=True, **GREEDY)
    )[0]
    assert len(on.token_ids) == 32 and on.outputs[0].finish_reason == "length"
    assert list(on.token_ids) == hf_greedy(ids, 32, ignore_eos=True)
    off = singles[4]  # the same request without ignore_eos
    eos = set(llm.engine.eos_token_ids)
    assert off.outputs[0].finish_reason == "stop"
    assert off.token_ids[-1] in eos
    assert not eos & set(off.token_ids[:-1])
    assert list(off.token_ids) == list(on.token_ids[: len(off.token_ids)])


def test_template_prompts_batch_equals_single(tiny):
    """CASES C8: prompts from one template with different-length codes: batch == one at a time."""
    codes = ["A1", "B22-7", "C333-xx-9", "D4444-yyyy-88-q", "E5"]
    prompts = [f"Repeat the code exactly: {c}. The code is" for c in codes]
    sp = SamplingParams(max_tokens=16, **GREEDY)
    batch = [list(o.token_ids) for o in tiny.generate(prompts, sp)]
    single = [list(tiny.generate(p, sp)[0].token_ids) for p in prompts]
    assert batch == single


def test_stop_string_truncates_text(llm, prompt_ids, singles):
    """Stop strings are matched on decoded text and cut from the returned text."""
    ids, full = prompt_ids[3], singles[3]
    assert "Paris" in full.text
    out = llm.generate(
        {"prompt_token_ids": ids}, SamplingParams(max_tokens=32, stop=["Paris"], **GREEDY)
    )[0]
    assert out.outputs[0].finish_reason == "stop"
    assert out.outputs[0].stop_reason == "Paris"
    assert out.text == full.text[: full.text.find("Paris")]
    assert len(out.token_ids) <= len(full.token_ids)


def test_compiles_are_bounded(tiny):
    """Every compiled forward and sampler is one of the planned set; the count is reported."""
    tiny.generate(["Hi", "The capital of France is"], SamplingParams(max_tokens=3, **GREEDY))
    planned, stats = tiny.engine.runner.buckets.planned(), tiny.engine.stats()
    assert stats.forward_shapes <= set(planned["forward"])
    assert stats.sampler_shapes <= set(planned["sampler"])
    assert {k.decode for k in stats.forward_shapes} == {True, False}
    assert stats.num_compiles == len(stats.compiled_shapes) > 0


def test_stop_string_completed_by_the_last_allowed_token(tiny):
    """A stop string finished by the max_tokens-th token still ends with 'stop' and is cut."""
    sp = SamplingParams(max_tokens=12, ignore_eos=True, **GREEDY)
    full = tiny.generate("The capital of France is", sp)[0]
    ids = list(full.token_ids)
    k = next(i for i in range(2, 12) if tiny.get_tokenizer().decode(ids[i : i + 1]).strip())
    stop = tiny.get_tokenizer().decode(ids[k : k + 1]).strip()
    first = full.text.find(stop)
    n = len(tiny.get_tokenizer().decode(ids[: k + 1]))
    out = tiny.generate(
        "The capital of France is",
        SamplingParams(max_tokens=k + 1, ignore_eos=True, stop=[stop], **GREEDY),
    )[0]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == stop
    assert out.text == full.text[:first] and first < n


def test_stop_string_spanning_many_tokens(tiny):
    """A stop string longer than 16 tokens is still found (the match window follows its length)."""
    sp = SamplingParams(max_tokens=60, ignore_eos=True, **GREEDY)
    full = tiny.generate("Once upon a time", sp)[0]
    tok = tiny.get_tokenizer()
    stop = tok.decode(list(full.token_ids[2:26]), skip_special_tokens=True)  # 24 tokens
    assert len(stop) > 16  # one character a token (the tiny tokenizer), specials left out
    out = tiny.generate(
        "Once upon a time", SamplingParams(max_tokens=60, ignore_eos=True, stop=[stop], **GREEDY)
    )[0]
    assert out.outputs[0].finish_reason == "stop" and stop not in out.text
    assert out.text == full.text[: full.text.find(stop)]


def test_from_params_matches_hf(llm, hf_greedy, prompt_ids, smollm_engine):
    """LLM.from_params over the loaded weights (no tokenizer) gives HF's greedy tokens (the
    shared LLM's engine arguments: its compiled steps come from the run-wide cache)."""
    loaded = llm.engine  # the shared LLM's config and float32 weights, loaded once
    llm = LLM.from_params(loaded.model_config, loaded.runner.params, **smollm_engine)
    assert llm.get_tokenizer() is None
    ids = prompt_ids[0]
    out = llm.generate(
        {"prompt_token_ids": ids}, SamplingParams(max_tokens=12, ignore_eos=True, **GREEDY)
    )[0]
    assert list(out.token_ids) == hf_greedy(ids, 12, ignore_eos=True)
    with pytest.raises(ValueError, match="unknown engine argument"):
        LLM.from_params(loaded.model_config, loaded.runner.params, max_batch=3)


def test_stop_token_and_eos_reasons_follow_vllm(llm, prompt_ids, singles):
    """A stop token id: finish "stop", stop_reason = that id, its text left out of ``text`` (and of
    the streamed text), the id kept in ``token_ids``. EOS: finish "stop", stop_reason None."""
    ids, full = prompt_ids[3], singles[3]  # "What is the capital of France?" -> "... Paris."
    assert full.outputs[0].finish_reason == "stop" and full.outputs[0].stop_reason is None  # EOS
    tok = llm.get_tokenizer()
    k = next(
        i for i in range(1, len(full.token_ids)) if tok.decode(full.token_ids[i : i + 1]).strip()
    )
    stop_id = full.token_ids[k]
    got = {}
    out = llm.generate(
        {"prompt_token_ids": ids},
        SamplingParams(max_tokens=32, temperature=0.0, stop_token_ids=[stop_id]),
        stream=lambda i, _t, d: got.__setitem__(i, got.get(i, "") + d),
    )[0]
    assert list(out.token_ids) == list(full.token_ids[: k + 1])
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == stop_id
    assert out.text == tok.decode(list(full.token_ids[:k]), skip_special_tokens=True)
    assert got[0] == out.text
