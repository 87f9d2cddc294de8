"""Structured output through the official ``openai`` client (issue 30 item 2): ``response_format``
(json_schema, json_object) on chat and completions, vLLM's ``structured_outputs`` extra body,
streamed and not, ``tool_choice`` (a named function, "required") as OpenAI's ``tool_calls``, and
400s for a bad schema or tool choice. The random tiny model would emit whitespace for ever inside
JSON, so the schemas ask llguidance for compact JSON (``x-guidance``, ignored by ``jsonschema``)
or the requests sample (seeded)."""

import json
import re

import pytest

openai = pytest.importorskip("openai")  # the GPU machine has no openai client
jsonschema = pytest.importorskip("jsonschema")

from .conftest import MODEL

COMPACT = {"whitespace_flexible": False}
PLACE = {
    "type": "object",
    "additionalProperties": False,
    "x-guidance": COMPACT,
    "required": ["city", "zip", "rank"],
    "properties": {
        "city": {"type": "string", "maxLength": 8},
        "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
        "rank": {"enum": ["low", "high"]},
        "tags": {
            "type": "array",
            "items": {"type": "integer", "minimum": 0, "maximum": 9},
            "maxItems": 2,
        },
    },
}
WEATHER = {
    "type": "object",
    "additionalProperties": False,
    "x-guidance": COMPACT,
    "required": ["unit"],
    "properties": {
        "unit": {"enum": ["C", "F"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
}
TOOLS = [
    {"type": "function", "function": {"name": name, "parameters": params}}
    for name, params in (("get_weather", WEATHER), ("find_place", PLACE))
]
ASK = [{"role": "user", "content": "Where shall we go?"}]


def test_chat_json_schema_streamed_and_not(client):
    kw = dict(
        model=MODEL,
        messages=ASK,
        temperature=0,
        max_tokens=80,
        response_format={"type": "json_schema", "json_schema": {"name": "place", "schema": PLACE}},
    )
    choice = client.chat.completions.create(**kw).choices[0]
    assert choice.finish_reason == "stop"
    jsonschema.validate(json.loads(choice.message.content), PLACE)
    chunks = list(client.chat.completions.create(**kw, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == choice.message.content
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_completions_json_object_and_extra_body(client):
    kw = dict(model=MODEL, prompt="A JSON object:", max_tokens=60, temperature=1.0, seed=3)
    obj = client.completions.create(**kw, extra_body={"response_format": {"type": "json_object"}})
    assert obj.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(obj.choices[0].text), dict)
    answers = client.completions.create(
        **kw, n=3, extra_body={"structured_outputs": {"choice": ["yes", "no", "maybe so"]}}
    ).choices
    assert {c.text for c in answers} <= {"yes", "no", "maybe so"}
    assert all(c.finish_reason == "stop" for c in answers)
    regex = r"[a-z]{2,6}-[0-9]{2}"
    chunks = client.completions.create(
        **kw, stream=True, extra_body={"structured_outputs": {"regex": regex}}
    )
    assert re.fullmatch(regex, "".join(c.choices[0].text for c in chunks))


def test_tool_choice_named_function(client):
    kw = dict(
        model=MODEL,
        messages=ASK,
        temperature=0,
        max_tokens=60,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    choice = client.chat.completions.create(**kw).choices[0]
    (call,) = choice.message.tool_calls
    assert choice.finish_reason == "stop" and choice.message.content is None
    assert call.type == "function" and call.function.name == "get_weather" and call.id
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)
    deltas = [
        d
        for c in client.chat.completions.create(**kw, stream=True)
        for d in c.choices[0].delta.tool_calls or ()
    ]
    assert deltas[0].function.name == "get_weather" and deltas[0].id
    assert "".join(d.function.arguments for d in deltas) == call.function.arguments
    assert all(d.index == 0 and d.function.name is None for d in deltas[1:])


def test_tool_choice_required(client):
    choice = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        temperature=1.0,
        seed=3,
        max_tokens=200,
        tools=TOOLS,
        tool_choice="required",
    ).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for call in choice.message.tool_calls:
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])


@pytest.mark.parametrize(
    "extra, needle, param",
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "nope"}},
                }
            },
            "nope",
            "response_format",
        ),
        (
            {"structured_outputs": {"regex": "(", "choice": ["a"]}},
            "exactly one",
            "structured_outputs",
        ),
        ({"structured_outputs": {"regex": "("}}, "unclosed group", "structured_outputs"),
        ({"structured_outputs": {"choice": "yes"}}, "non-empty list", "structured_outputs"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "x"}}},
            "'x'",
            "tool_choice",
        ),
        ({"tools": TOOLS, "tool_choice": "auto"}, "auto", "tool_choice"),
    ],
)
def test_bad_constraints_are_400(client, extra, needle, param):
    """The error names the field at fault (OpenAI's ``param``), also when the engine core found
    it (an invalid schema or regex), not the messages the request was checked with."""
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4, extra_body=extra)
    assert e.value.status_code == 400 and needle in e.value.body["message"]
    assert e.value.body["param"] == param
    ok = client.chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=4, temperature=0, extra_body={"ignore_eos": True}
    )
    assert ok.choices[0].finish_reason == "length"
