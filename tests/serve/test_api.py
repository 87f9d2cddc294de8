"""The OpenAI API through the official ``openai`` client (issue 19 items 1, 4 and 5): completions
and chat, streamed and not, n, logprobs, stop, seeds, usage; /metrics (errors: test_api_errors.py)
"""

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
