"""OpenAI's error JSON from the server: bad parameters (400 naming the parameter), malformed
bodies, wrong methods and paths; unknown request fields ignored with a warning, as vLLM."""

import asyncio
import json

import pytest

pytest.importorskip("openai")  # the GPU machine has no openai client; the fixtures need it


@pytest.mark.parametrize(
    "body, status, param, words",
    [
        ({"prompt": "x", "temperature": -1}, 400, "temperature", ["temperature=-1", ">= 0"]),
        ({"prompt": "x", "top_p": 0}, 400, "top_p", ["(0, 1]"]),
        ({"prompt": "x", "max_tokens": 0}, 400, "max_tokens", ["max_tokens=0"]),
        ({"prompt": "x", "n": 0}, 400, "n", ["n=0"]),
        ({"prompt": "x", "logprobs": 21}, 400, "logprobs", ["[0, 20]"]),
        ({"prompt": "x", "prompt_logprobs": 21}, 400, "prompt_logprobs", ["=21", "[0, 20]"]),
        ({"prompt": "x", "prompt_logprobs": -1}, 400, "prompt_logprobs", ["=-1", "[0, 20]"]),
        ({"prompt": "x", "prompt_logprobs": 1, "stream": True}, 400, "prompt_logprobs", ["stream"]),
        (
            {
                "messages": [{"role": "user", "content": "hi"}],
                "prompt_logprobs": 30,
                "_path": "/v1/chat/completions",
            },
            400,
            "prompt_logprobs",
            ["=30", "[0, 20]"],
        ),
        ({"prompt": "x", "presence_penalty": 3}, 400, "presence_penalty", ["[-2, 2]"]),
        ({"prompt": "x", "temperature": "hot"}, 400, "temperature", []),
        ({"prompt": [10**30], "max_tokens": 1}, 400, "prompt", ["out of range"]),
        ({"prompt": "x", "max_tokens": 10**30}, 400, "prompt", ["maximum context length is 256"]),
        # vLLM's 400 (serving_engine.py's wording); the engine offline would run it to "length"
        (
            {"prompt": [5, 6], "max_tokens": 300},
            400,
            "prompt",
            [
                "This model's maximum context length is 256 tokens. However, you requested 302 "
                "tokens (2 in the messages, 300 in the completion). Please reduce the length of "
                "the messages or completion."
            ],
        ),
        ({"prompt": "word " * 70}, 400, "prompt", ["maximum context length is 256 tokens"]),
        (
            {
                "messages": [{"role": "user", "content": "word " * 70}],
                "_path": "/v1/chat/completions",
            },
            400,
            "messages",
            ["context length is 256 tokens. However, you requested", "tokens in the messages, "],
        ),
        ({"prompt": [[]]}, 400, "prompt", ["0 tokens"]),
        ({"prompt": [10**9]}, 400, "prompt", ["out of range"]),
        # echo decodes a token-id prompt's text: an id no tokenizer takes is the same 400
        ({"prompt": [-1], "echo": True}, 400, "prompt", ["id -1 is out of range"]),
        ({"prompt": [[5], [2**32]], "echo": True}, 400, "prompt", ["out of range"]),
        ({}, 400, "prompt", []),
        ({"prompt": "x", "model": "gpt-4"}, 404, "model", ["gpt-4"]),
        ({"messages": [], "_path": "/v1/chat/completions"}, 400, "messages", []),
        (
            {
                "messages": [{"role": "user", "content": "hi"}],
                "top_logprobs": 2,
                "_path": "/v1/chat/completions",
            },
            400,
            "top_logprobs",
            ["logprobs"],
        ),
        (
            {"messages": [{"role": "robot", "content": "hi"}], "_path": "/v1/chat/completions"},
            400,
            "messages.0.role",
            ["'developer', 'system', 'user', 'assistant' or 'tool'", "'robot'"],
        ),
        # 500s before content parts and tool_choice were typed (found while writing test_fuzz.py)
        (
            {
                "messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}],
                "_path": "/v1/chat/completions",
            },
            400,
            "messages.0.content.0.text",
            ["(got 5)"],
        ),
        (  # a text-only model: an image part is refused, not dropped from the prompt
            {
                "messages": [
                    {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}
                ],
                "_path": "/v1/chat/completions",
            },
            400,
            "messages.0.content.0.type",
            ["'image_url'", "text only"],
        ),
        (
            {
                "messages": [{"role": "user", "content": "hi"}],
                "tools": [{"function": {"name": "f"}}],
                "tool_choice": {"function": "f"},
                "_path": "/v1/chat/completions",
            },
            400,
            "tool_choice.function",
            ["(got 'f')"],
        ),
        (
            {
                "messages": [{"role": "user", "content": "hi"}],
                "max_completion_tokens": 0,
                "max_tokens": 4,
                "_path": "/v1/chat/completions",
            },
            400,
            "max_tokens",
            ["max_tokens=0"],
        ),  # not ignored
        # the engine's checks name the field, not the prompt, and no "request 0:" for one prompt
        (
            {"prompt": "hi", "stop_token_ids": [10**6]},
            400,
            "stop_token_ids",
            ["stop_token_ids contains 1000000, out of range"],
        ),
        (
            {"prompt": "hi", "logit_bias": {"1000000": 5}},
            400,
            "logit_bias",
            ["logit_bias has token id 1000000, out of range"],
        ),
        # found by the 10,000-case fuzz (BENCHMARKS.md): a 500, or a stream cut short
        (
            {
                "messages": [{"role": "user"}],
                "tools": [{"function": {"name": ""}}],
                "stream": True,
                "tool_choice": {"type": "function", "function": {"name": ""}},
                "_path": "/v1/chat/completions",
            },
            400,
            "tools.0.function.name",
            ["at least 1 character"],
        ),
    ],
)
def test_bad_parameters(server, raw, body, status, param, words):
    path = body.pop("_path", "/v1/completions")
    got, payload = asyncio.run(raw(server.port, json.dumps(body).encode(), path=path))
    err = json.loads(payload)["error"]
    assert got == status and err["param"] == param, err
    assert set(err) == {"message", "type", "param", "code"}
    assert not err["message"].startswith("request 0"), err
    assert err["code"] is None or isinstance(err["code"], str), err  # OpenAI's: never a number
    assert all(w in err["message"] for w in words), err["message"]


@pytest.mark.parametrize(
    "body, status",
    [
        (b"{not json", 400),
        (b'{"prompt": "\xff\xfe"}', 400),
        (b"[1, 2]", 400),
        (b'{"prompt": "' + b"a" * (9 << 20) + b'"}', 413),
    ],
)
def test_malformed_bodies(server, raw, body, status):
    got, payload = asyncio.run(raw(server.port, body))
    err = json.loads(payload)["error"]
    assert got == status and err["type"] == "invalid_request_error" and err["code"] is None, err
    if body == b"{not json":
        assert err["param"] is None and "not valid JSON" in err["message"], err
    if b"\xff" in body:  # not UTF-8: said so, not FastAPI's "error parsing the body"
        assert "UTF-8 encoded JSON" in err["message"], err


def test_wrong_method_is_a_client_error(server, raw):
    got, payload = asyncio.run(raw(server.port, b"", method="GET"))
    err = json.loads(payload)["error"]
    assert got == 405 and err["type"] == "invalid_request_error", err


def test_unknown_path_is_openai_json(server, raw):
    got, payload = asyncio.run(raw(server.port, b"{}", path="/v1/nothing"))
    assert got == 404 and json.loads(payload)["error"]["message"]


def test_unknown_fields_are_logged_and_ignored(caplog):
    """As vLLM: a field the server does not know is ignored, with a warning naming it."""
    import types

    from jaxinfer.serve import protocol as P
    from jaxinfer.serve.completions import OpenAIServing

    body = P.CompletionRequest(prompt="x", bogus=1, return_token_ids=True)
    fake = types.SimpleNamespace(
        model_name="m",
        loras=None,
        _lora=lambda b: None,
        client=types.SimpleNamespace(info={"max_num_seqs": 4}),
    )
    with caplog.at_level("WARNING", logger="jaxinfer.serve"):
        sp = OpenAIServing.sampling_params(fake, body, 16, None)
    assert sp.max_tokens == 16
    assert "['bogus', 'return_token_ids']" in caplog.text and "ignored" in caplog.text
