"""The OpenAI API through the official ``openai`` client (issue 19 items 1, 4 and 5): completions
and chat, streamed and not, n, logprobs, stop, seeds, usage; OpenAI's error JSON; /metrics."""

import asyncio
import json
import math

import pytest

openai = pytest.importorskip("openai")  # the GPU machine has no openai client

from .conftest import MODEL, PROMPTS

GREEDY = dict(temperature=0, extra_body={"ignore_eos": True})


def test_models_health_and_auth(server, client, raw):
    assert [m.id for m in client.models.list().data] == [MODEL]
    status, _ = asyncio.run(raw(server.port, b"", path="/health", method="GET"))
    assert status == 200
    for key in (None, "wrong"):
        status, body = asyncio.run(
            raw(
                server.port,
                b'{"prompt": "x"}',
                headers={"Authorization": None if key is None else f"Bearer {key}"},
            )
        )
        assert status == 401 and json.loads(body)["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url, api_key="wrong", max_retries=0).models.list()


def test_completion_stream_equals_non_stream_and_usage(server, client):
    llm = server.llm
    for prompt in PROMPTS[:2]:
        full = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, **GREEDY)
        (choice,) = full.choices
        assert choice.finish_reason == "length"
        assert full.usage.prompt_tokens == len(llm.get_tokenizer().encode(prompt))
        assert full.usage.completion_tokens == 8
        assert full.usage.total_tokens == full.usage.prompt_tokens + 8
        chunks = list(
            client.completions.create(
                model=MODEL,
                prompt=prompt,
                max_tokens=8,
                stream=True,
                stream_options={"include_usage": True},
                **GREEDY,
            )
        )
        assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
        assert chunks[-1].usage.completion_tokens == 8 and not chunks[-1].choices
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
        ids = client.completions.create(
            model=MODEL, prompt=llm.get_tokenizer().encode(prompt), max_tokens=8, **GREEDY
        )
        assert ids.choices[0].text == choice.text


def test_several_prompts_and_token_id_prompts(client, server):
    ids = [server.llm.get_tokenizer().encode(p) for p in PROMPTS[:2]]
    out = client.completions.create(model=MODEL, prompt=ids, max_tokens=5, **GREEDY)
    single = [
        client.completions.create(model=MODEL, prompt=p, max_tokens=5, **GREEDY).choices[0].text
        for p in PROMPTS[:2]
    ]
    assert [c.index for c in out.choices] == [0, 1]
    assert [c.text for c in out.choices] == single
    assert out.usage.prompt_tokens == sum(map(len, ids)) and out.usage.completion_tokens == 10


def test_chat_stream_equals_non_stream(server, client):
    msgs = [
        {"role": "system", "content": "You are brief."},
        {"role": "user", "content": "What is the capital of France?"},
    ]
    full = client.chat.completions.create(
        model=MODEL, messages=msgs, max_completion_tokens=10, **GREEDY
    )
    assert full.choices[0].message.role == "assistant"
    assert full.usage.prompt_tokens == len(server.llm.apply_chat_template(msgs))
    assert full.usage.completion_tokens == 10
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=msgs, max_tokens=10, stream=True, **GREEDY
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert (
        "".join(c.choices[0].delta.content or "" for c in chunks) == full.choices[0].message.content
    )
    assert chunks[-1].choices[0].finish_reason == "length"


def test_chat_roles(server, client):
    """OpenAI's roles, "developer" too (vLLM takes it), reach the chat template as they are;
    another role is a 400 (`test_bad_parameters`)."""
    msgs = [
        {"role": r, "content": r}
        for r in ("developer", "system", "user", "assistant", "tool", "user")
    ]
    out = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=1, **GREEDY)
    assert out.usage.prompt_tokens == len(server.llm.apply_chat_template(msgs))


def test_stop_string(client):
    base = client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=12, **GREEDY)
    text = base.choices[0].text
    stop = text[5:7]  # two characters in the middle of the greedy text
    cut = text[: text.find(stop)]
    out = client.completions.create(
        model=MODEL, prompt=PROMPTS[2], max_tokens=12, stop=[stop], **GREEDY
    )
    assert out.choices[0].text == cut and out.choices[0].finish_reason == "stop"
    chunks = list(
        client.completions.create(
            model=MODEL, prompt=PROMPTS[2], max_tokens=12, stop=stop, stream=True, **GREEDY
        )
    )
    assert "".join(c.choices[0].text for c in chunks) == cut


def test_seed_reproducible(client):
    kw = dict(model=MODEL, prompt=PROMPTS[4], max_tokens=6, temperature=1.0, top_p=0.95, seed=1234)
    a, b = (client.completions.create(**kw).choices[0].text for _ in range(2))
    streamed = "".join(c.choices[0].text for c in client.completions.create(**kw, stream=True))
    other = {client.completions.create(**{**kw, "seed": s}).choices[0].text for s in range(2)}
    assert a == b == streamed
    assert len(other | {a}) > 1


def test_n2(client):
    """Two samples of one prompt (needs the engine's n > 1, helper A)."""
    out = client.completions.create(
        model=MODEL,
        prompt=PROMPTS[0],
        max_tokens=6,
        n=2,
        seed=7,
        temperature=1.0,
        extra_body={"ignore_eos": True},
    )
    assert sorted(c.index for c in out.choices) == [0, 1]
    assert out.usage.completion_tokens == 12
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Hi"}],
            max_tokens=6,
            n=2,
            seed=7,
            stream=True,
            extra_body={"ignore_eos": True},
        )
    )
    assert {c.choices[0].index for c in chunks} == {0, 1}
    assert sum(c.choices[0].finish_reason == "length" for c in chunks) == 2


def test_logprobs(client):
    """Completions logprobs=3 and chat top_logprobs=2 (needs the engine's logprobs, helper B):
    greedy, so each chosen token is the likeliest of its top list."""
    out = client.completions.create(
        model=MODEL, prompt=PROMPTS[0], max_tokens=6, logprobs=3, **GREEDY
    )
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    # the text leaves special tokens out (skip_special_tokens); the token list names them
    specials = {"<unk>", "<|im_start|>", "<|im_end|>"}
    assert "".join(t for t in lp.tokens if t not in specials) == out.choices[0].text
    for x, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert len(top) <= 3 and x <= 0 and math.isclose(max(top.values()), x, abs_tol=1e-5)
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=4,
        logprobs=True,
        top_logprobs=2,
        **GREEDY,
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == 4
    for e in content:
        assert len(e.top_logprobs) == 2 and e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob
        assert math.isclose(e.top_logprobs[0].logprob, e.logprob, abs_tol=1e-5)


@pytest.mark.parametrize(
    "body, status, param, words",
    [
        ({"prompt": "x", "temperature": -1}, 400, "temperature", ["temperature=-1", ">= 0"]),
        ({"prompt": "x", "top_p": 0}, 400, "top_p", ["(0, 1]"]),
        ({"prompt": "x", "max_tokens": 0}, 400, "max_tokens", ["max_tokens=0"]),
        ({"prompt": "x", "n": 0}, 400, "n", ["n=0"]),
        ({"prompt": "x", "logprobs": 21}, 400, "logprobs", ["[0, 20]"]),
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


def _scrape(server, raw) -> dict:
    from prometheus_client.parser import text_string_to_metric_families

    status, body = asyncio.run(raw(server.port, b"", path="/metrics", method="GET"))
    assert status == 200
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(body.decode())
        for s in fam.samples
    }


def test_metrics_agree_with_requests(server, client, raw, wait_idle):
    wait_idle(server)
    before = _scrape(server, raw)
    usages = [
        client.completions.create(model=MODEL, prompt=p, max_tokens=3 + i, **GREEDY).usage
        for i, p in enumerate(PROMPTS[:4])
    ]
    wait_idle(server)
    after = _scrape(server, raw)

    def delta(name, **labels):
        key = (f"jaxinfer:{name}", tuple(sorted(labels.items())))
        return after.get(key, 0) - before.get(key, 0)

    assert delta("request_success_total", finished_reason="length") == 4
    assert delta("prompt_tokens_total") == sum(u.prompt_tokens for u in usages)
    assert delta("generation_tokens_total") == sum(u.completion_tokens for u in usages)
    for h in (
        "time_to_first_token_seconds",
        "e2e_request_latency_seconds",
        "time_per_output_token_seconds",
    ):
        assert delta(f"{h}_count") == 4
    assert after[("jaxinfer:num_requests_running", ())] == 0
    assert after[("jaxinfer:num_requests_waiting", ())] == 0
    assert after[("jaxinfer:kv_pages_in_use", ())] == 0
    for name in ("drafts", "draft_tokens", "accepted_tokens"):  # no speculation: zero counters
        assert after[(f"jaxinfer:spec_decode_num_{name}_total", ())] == 0
    _, body = asyncio.run(raw(server.port, b"", path="/metrics", method="GET"))
    assert b"# TYPE jaxinfer:spec_decode_num_accepted_tokens_per_pos_total counter" in body


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
