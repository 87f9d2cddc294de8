"""Structured output (issue 30): SmolLM2's constrained outputs validate (JSON schema with enums,
bounded arrays, nested objects and string patterns; regex; choice; any JSON object), greedy and
sampled in one batch whose free rows equal the same prompts run without them; on the tiny model,
the mechanics: async and sync scheduling, preemption by recompute, prefix caching, n samples,
stop strings, max_tokens and logprobs of the masked distribution; invalid specs rejected."""

import json
import math
import re

import pytest

from jaxinfer import LLM, SamplingParams, StructuredOutputsParams

jsonschema = pytest.importorskip("jsonschema")

PERSON = {
    "type": "object",
    "additionalProperties": False,
    "required": ["name", "age", "role", "skills", "address"],
    "properties": {
        "name": {"type": "string", "pattern": "^[A-Z][a-z]{1,11}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["student", "teacher", "engineer"]},
        "skills": {
            "type": "array",
            "items": {"type": "string", "maxLength": 12},
            "minItems": 1,
            "maxItems": 3,
        },
        "address": {
            "type": "object",
            "additionalProperties": False,
            "required": ["city", "zip"],
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
        },
    },
}
PHONE = r"\(\d{3}\) \d{3}-\d{4}"
CITIES = ["Paris", "London", "Berlin"]


def test_smollm2_constrained_rows_validate_and_free_rows_unchanged(llm):
    """One batch of 8 rows (one set of step shapes): JSON schema greedy and sampled (n=2), a
    regex, a choice, any JSON object, and two free greedy rows, which equal their run alone."""

    def chat(q):
        return {"prompt_token_ids": llm.apply_chat_template([{"role": "user", "content": q}])}

    so = StructuredOutputsParams
    rows = [
        (
            chat("Describe a person as JSON."),
            dict(temperature=0, structured_outputs=so(json=PERSON)),
        ),
        (
            chat("Describe a person as JSON."),
            dict(temperature=0.8, seed=3, n=2, structured_outputs=so(json=PERSON)),
        ),
        (
            chat("Give a US phone number."),
            dict(temperature=0.8, seed=1, structured_outputs=so(regex=PHONE)),
        ),
        (
            chat("What is the capital of France?"),
            dict(temperature=0, structured_outputs=so(choice=CITIES)),
        ),
        (
            chat("Give me any JSON object."),
            dict(temperature=0.8, seed=2, structured_outputs=so(json_object=True)),
        ),
        (chat("What is the capital of France?"), dict(temperature=0)),
        (chat("Name a color."), dict(temperature=0)),
    ]
    outs = llm.generate(
        [p for p, _ in rows], [SamplingParams(max_tokens=100, **kw) for _, kw in rows]
    )
    eos = set(llm.engine.eos_token_ids)
    for o in outs[:5]:
        for c in o.outputs:
            assert c.finish_reason == "stop" and c.token_ids[-1] in eos, c
    for c in outs[0].outputs + outs[1].outputs:
        jsonschema.validate(json.loads(c.text), PERSON)
    assert len(outs[1].outputs) == 2
    assert re.fullmatch(PHONE, outs[2].text)
    assert outs[3].text in CITIES
    assert isinstance(json.loads(outs[4].text), dict)
    alone = llm.generate(
        [p for p, _ in rows[5:]], [SamplingParams(max_tokens=100, **kw) for _, kw in rows[5:]]
    )
    assert [o.token_ids for o in alone] == [o.token_ids for o in outs[5:]]
    assert outs[5].outputs[0].finish_reason == "stop"


WORDS = r"[a-z]{2,8}( [a-z]{2,8}){2,5}\."


@pytest.fixture(scope="module")
def small_pool(tiny_llm):
    # 7 usable pages of 16 tokens: each request fits alone, all of them together do not
    return tiny_llm(max_model_len=256, page_size=16, num_pages=8, max_compiles=16)


def _mechanics(llm):
    so = StructuredOutputsParams
    prompts = ["Once upon a time", "The answer is", "Colors:", "Hello there", "1, 2, 3,"]
    params = [
        SamplingParams(
            temperature=0.9, seed=5, n=2, max_tokens=60, structured_outputs=so(regex=WORDS)
        ),
        SamplingParams(
            temperature=0,
            max_tokens=8,
            logprobs=3,
            structured_outputs=so(choice=["yes", "no", "never"]),
        ),
        SamplingParams(
            temperature=0.9,
            seed=2,
            max_tokens=60,
            stop=["b"],
            structured_outputs=so(regex="[abc]{30,50}"),
        ),
        SamplingParams(
            temperature=0.9, seed=4, max_tokens=6, structured_outputs=so(regex="[0-9]{10,20}")
        ),
        SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
    ]
    return prompts, params


def test_tiny_mechanics_async_sync_preemption_prefix_cache(tiny, small_pool):
    prompts, params = _mechanics(tiny)
    results = []
    for llm, mode in ((tiny, True), (tiny, True), (small_pool, False), (small_pool, True)):
        llm.engine.async_scheduling = mode
        outs = llm.generate(prompts, params)
        results.append([(c.token_ids, c.text, c.finish_reason) for o in outs for c in o.outputs])
        if llm is small_pool:
            assert sum(o.metrics.num_preemptions for o in outs) > 0
    small_pool.engine.async_scheduling = True
    assert results[0] == results[1] == results[2] == results[3]
    (a, b), choice, stop, length, free = outs[0].outputs, outs[1], outs[2], outs[3], outs[4]
    assert re.fullmatch(WORDS, a.text) and re.fullmatch(WORDS, b.text) and a.text != b.text
    assert choice.text in ("yes", "no", "never") and choice.outputs[0].finish_reason == "stop"
    assert stop.outputs[0].stop_reason == "b" and re.fullmatch("[ac]*", stop.text)
    assert length.outputs[0].finish_reason == "length" and len(length.token_ids) == 6
    assert re.fullmatch("[0-9]{6}", length.text) and len(free.token_ids) == 40
    allowed = {tiny.get_tokenizer().encode(w[:1])[0] for w in ("yes", "no", "never")}
    first = choice.outputs[0].logprobs[0]  # the masked distribution, as vLLM's
    assert {t for t, lp in first.items() if lp.logprob > -math.inf} == allowed
    assert math.fsum(math.exp(first[t].logprob) for t in allowed) == pytest.approx(1, abs=1e-5)
    assert all(lp.logprob == -math.inf for t, lp in first.items() if t not in allowed)


def test_tiny_cached_prompt_keeps_constrained_output(tiny):
    prompts, params = _mechanics(tiny)
    first = tiny.generate(prompts[1] * 20, params[1])[0]
    again = tiny.generate(prompts[1] * 20, params[1])[0]
    assert again.num_cached_tokens > 0 and again.token_ids == first.token_ids


def test_invalid_specs_rejected_others_run(tiny, tiny_text_cfg, tiny_text_params):
    so = StructuredOutputsParams
    bad = [so(regex="("), so(json='{"type": "nope"}'), so(grammar="start: (")]
    outs = tiny.generate(
        ["a"] * 4,
        [SamplingParams(max_tokens=3, structured_outputs=s) for s in bad]
        + [SamplingParams(max_tokens=3)],
        on_error="return",
    )
    assert "unclosed group" in outs[0].error and "StructuredOutputsParams.regex" in outs[0].error
    assert all("\n" not in o.error for o in outs[:3])  # one line (the CLI prints it as its line)
    assert "nope" in outs[1].error and "StructuredOutputsParams.grammar" in outs[2].error
    assert outs[3].error is None and len(outs[3].token_ids) == 3
    with pytest.raises(ValueError, match="exactly one of json, regex"):
        so(regex="a", choice=["a"])
    bare = LLM.from_params(
        tiny_text_cfg, tiny_text_params, max_model_len=64, num_pages=8, dtype="float32"
    )
    with pytest.raises(ValueError, match="needs a tokenizer"):
        bare.generate(
            {"prompt_token_ids": [5, 6]}, SamplingParams(structured_outputs=so(choice=["a"]))
        )


def test_tiny_overlapped_constrained_steps_equal_sync(tiny):
    """Under async scheduling a constrained step's forward is dispatched before the previous step
    is read back (its masks and sampling after): the same outputs and logprobs as the sync path,
    for a schema/regex/choice mix with free rows, a grammar that stops early, and n=2."""
    so = StructuredOutputsParams
    schema = {
        "type": "object",
        "properties": {"a": {"type": "integer"}},
        "required": ["a"],
        "additionalProperties": False,
        "x-guidance": {"whitespace_flexible": False},
    }
    prompts = ["Once upon a time", "The answer is", "Colors:", "Hello there", "1, 2, 3,"]
    params = [
        SamplingParams(
            temperature=0.9,
            seed=7,
            n=2,
            max_tokens=30,
            logprobs=2,
            structured_outputs=so(json=schema),
        ),
        SamplingParams(temperature=0, max_tokens=30, structured_outputs=so(regex="ab?")),
        SamplingParams(temperature=0.9, seed=3, max_tokens=25, structured_outputs=so(regex=WORDS)),
        SamplingParams(temperature=0, max_tokens=5, structured_outputs=so(choice=["yes", "no"])),
        SamplingParams(temperature=0.8, seed=1, max_tokens=20),
    ]
    results, overlapped = [], []
    for mode in (False, True):
        tiny.engine.async_scheduling = mode
        before = tiny.engine.stats().num_overlapped_steps
        outs = tiny.generate(prompts, params)
        overlapped.append(tiny.engine.stats().num_overlapped_steps - before)
        results.append(
            [(c.token_ids, c.finish_reason, c.logprobs) for o in outs for c in o.outputs]
        )
    tiny.engine.async_scheduling = True
    assert results[0] == results[1]
    assert overlapped[0] == 0 and overlapped[1] >= 20  # the constrained steps overlapped too
    short = outs[1].outputs[0]  # "a" or "ab", then EOS: the grammar stops early
    assert short.finish_reason == "stop" and len(short.token_ids) <= 3
    assert all(json.loads(c.text)["a"] is not None for c in outs[0].outputs)
    assert outs[3].text in ("yes", "no") and len(outs[4].token_ids) == 20
