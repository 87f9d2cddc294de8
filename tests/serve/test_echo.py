"""vLLM's ``echo`` and ``prompt_logprobs`` on the server: an echoed choice's text and logprobs
start with its prompt's (the first prompt token's entries null), as lm-evaluation-harness's
``local-completions`` reads them for log-likelihoods (``max_tokens`` 1, ``logprobs`` 1, ``echo``,
``token_logprobs[ctxlen:-1]``). References: `LLM.generate` with ``prompt_logprobs`` on the same
model in this process (``server.llm``; the library's prompt scorer is checked against HF
transformers in tests/e2e), and the sampler's own logprobs of each prefix's next token, a path
that shares no code with the prompt scorer."""

import itertools

import pytest

openai = pytest.importorskip("openai")

from jaxinfer import SamplingParams  # noqa: E402

from .conftest import MODEL, PROMPTS  # noqa: E402

TOL = 1e-4


def _library(server, prompt, k: int, max_tokens: int):
    """`LLM.generate`'s output of ``prompt`` (text, or ids) greedy with logprobs and prompt
    logprobs at ``k``."""
    p = prompt if isinstance(prompt, str) else {"prompt_token_ids": prompt}
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=k, prompt_logprobs=k)
    return server.llm.generate([p], sp, use_tqdm=False)[0]


def _top(rec, k: int) -> dict:
    return {x.decoded_token: x.logprob for x in rec.values() if x.rank is not None and x.rank <= k}


def _close(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(abs(a[s] - b[s]) <= TOL for s in a)


def _check_prompt_rows(lp, ref, k: int) -> None:
    """``lp`` (a choice's logprobs) starts with the rows of ``ref``'s prompt (`RequestOutput`)."""
    ids, n = ref.prompt_token_ids, len(ref.prompt_token_ids)
    assert len(ref.prompt_logprobs) == n and ref.prompt_logprobs[0] is None
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for i in range(1, n):
        rec = ref.prompt_logprobs[i]
        assert lp.tokens[i] == rec[ids[i]].decoded_token
        assert abs(lp.token_logprobs[i] - rec[ids[i]].logprob) <= TOL
        assert _close(lp.top_logprobs[i], _top(rec, k))


def test_echo_logprobs_equal_the_library(server, client):
    """A text prompt echoed with 4 greedy tokens, logprobs 2: text, tokens, offsets and the
    prompt's then the completion's log-probabilities as `LLM.generate`'s; vLLM's per-choice
    ``prompt_logprobs`` beside them."""
    ref = _library(server, PROMPTS[0], 2, 4)
    c = client.completions.create(
        model=MODEL, prompt=PROMPTS[0], max_tokens=4, temperature=0, logprobs=2, echo=True
    ).choices[0]
    n, out = len(ref.prompt_token_ids), ref.outputs[0]
    assert c.text == PROMPTS[0] + out.text
    lp = c.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == n + 4
    assert "".join(lp.tokens[:n]) == PROMPTS[0]  # one character a token
    assert lp.text_offset == list(itertools.accumulate(map(len, lp.tokens[:-1]), initial=0))
    _check_prompt_rows(lp, ref, 2)
    for i, (t, rec) in enumerate(zip(out.token_ids, out.logprobs)):
        assert lp.tokens[n + i] == rec[t].decoded_token
        assert abs(lp.token_logprobs[n + i] - rec[t].logprob) <= TOL
        assert _close(lp.top_logprobs[n + i], _top(rec, 2))
    plp = c.prompt_logprobs  # vLLM's field: {token id: {logprob, rank, decoded_token}}
    assert len(plp) == n and plp[0] is None
    for i in range(1, n):
        got = {int(t): v for t, v in plp[i].items()}
        assert got.keys() == ref.prompt_logprobs[i].keys()
        for t, x in ref.prompt_logprobs[i].items():
            assert abs(got[t]["logprob"] - x.logprob) <= TOL
            assert (got[t]["rank"], got[t]["decoded_token"]) == (x.rank, x.decoded_token)


def test_prompt_scorer_agrees_with_the_sampler(server, client):
    """Prompt position j's top 3 (echo) is the sampler's top 3 of the first token after the
    prefix ids[:j] (one request, a list of token-id prompts)."""
    ids = server.llm.get_tokenizer().encode(PROMPTS[1])
    echo = client.completions.create(
        model=MODEL, prompt=ids, max_tokens=1, temperature=0, logprobs=3, echo=True
    ).choices[0]
    js = [1, 4, len(ids) - 1]
    nxt = client.completions.create(
        model=MODEL, prompt=[ids[:j] for j in js], max_tokens=1, temperature=0, logprobs=3
    ).choices
    for j, c in zip(js, nxt):
        assert _close(echo.logprobs.top_logprobs[j], c.logprobs.top_logprobs[0])


@pytest.mark.parametrize("tokenized", [True, False])
def test_lm_eval_loglikelihood_request(server, client, tokenized):
    """lm-eval's request (a batch of (context, continuation) pairs, max_tokens 1, logprobs 1,
    echo, a seed): ``token_logprobs[ctxlen:-1]`` are the continuation's log-probabilities,
    ``top_logprobs`` say whether it is greedy; token ids or text."""
    tok = server.llm.get_tokenizer()
    pairs = [("The capital of France is", " Paris"), ("One, two, three,", " four")]
    ctx_ids = [tok.encode(a) for a, _ in pairs]
    full_ids = [tok.encode(a + b) for a, b in pairs]
    prompt = full_ids if tokenized else [a + b for a, b in pairs]
    r = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=1, temperature=0, logprobs=1, echo=True, seed=1234
    )
    assert len(r.choices) == 2
    for c, ctx, ids in zip(sorted(r.choices, key=lambda c: c.index), ctx_ids, full_ids):
        ref = _library(server, ids, 1, 1)
        cont = ids[len(ctx) :]
        got = c.logprobs.token_logprobs[len(ctx) : -1]
        want = [ref.prompt_logprobs[i][ids[i]].logprob for i in range(len(ctx), len(ids))]
        assert len(got) == len(cont) and all(abs(a - b) <= TOL for a, b in zip(got, want))
        greedy = all(
            max(top, key=top.get) == tok.decode([t])
            for top, t in zip(c.logprobs.top_logprobs[len(ctx) : -1], cont)
        )
        assert greedy == all(
            ref.prompt_logprobs[i][ids[i]].rank == 1 for i in range(len(ctx), len(ids))
        )
        assert c.text.startswith(tok.decode(ids, skip_special_tokens=False))


def test_stream_echo_equals_non_stream(server, client, wait_idle):
    """Streamed, the prompt comes in each choice's first chunk; the joined text and logprobs
    equal the whole response's (n 2, sampled with a seed, two prompts)."""
    args = dict(
        model=MODEL,
        prompt=PROMPTS[2:4],
        max_tokens=5,
        temperature=0.8,
        seed=7,
        n=2,
        logprobs=1,
        echo=True,
    )
    whole = {c.index: c for c in client.completions.create(**args).choices}
    text, lps, first = {}, {}, {}
    for chunk in client.completions.create(stream=True, **args):
        for c in chunk.choices:
            first.setdefault(c.index, c.text)
            text[c.index] = text.get(c.index, "") + c.text
            for f in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
                lps.setdefault(c.index, {}).setdefault(f, []).extend(getattr(c.logprobs, f))
    assert sorted(text) == sorted(whole) == [0, 1, 2, 3]
    for i, c in whole.items():
        prompt = PROMPTS[2 + i // 2]
        assert first[i].startswith(prompt) and text[i] == c.text
        assert lps[i]["tokens"] == c.logprobs.tokens
        assert lps[i]["text_offset"] == c.logprobs.text_offset
        assert lps[i]["token_logprobs"][0] is None and lps[i]["top_logprobs"][0] is None
        for a, b in zip(lps[i]["token_logprobs"][1:], c.logprobs.token_logprobs[1:]):
            assert abs(a - b) <= TOL
    wait_idle(server)  # every page free, no program compiled past the planned set and scorers


@pytest.mark.parametrize("stream", [False, True])
def test_echo_max_tokens_0_returns_the_prompt(client, stream):
    """vLLM's: echo with max_tokens 0 generates one token and returns the prompt alone."""
    r = client.completions.create(
        model=MODEL, prompt=PROMPTS[4], max_tokens=0, logprobs=0, echo=True, stream=stream
    )
    chunks = list(r) if stream else [r]
    choices = [c for ch in chunks for c in ch.choices]
    assert "".join(c.text for c in choices) == PROMPTS[4]
    toks = [t for c in choices for t in c.logprobs.tokens]
    assert "".join(toks) == PROMPTS[4]
    assert choices[-1].finish_reason == "length"
    if not stream:
        assert r.usage.prompt_tokens == len(PROMPTS[4]) and r.usage.completion_tokens == 1


def test_echo_without_logprobs_and_prompt_logprobs_alone(server, client):
    """echo without logprobs: the text only; prompt_logprobs without echo: vLLM's field, the
    text not echoed (a known field: no "ignored" warning)."""
    from jaxinfer.serve.protocol import CompletionRequest

    assert not CompletionRequest(prompt="x", prompt_logprobs=1, echo=True).model_extra
    c = client.completions.create(
        model=MODEL, prompt=PROMPTS[5], max_tokens=3, temperature=0, echo=True
    ).choices[0]
    plain = client.completions.create(
        model=MODEL,
        prompt=PROMPTS[5],
        max_tokens=3,
        temperature=0,
        extra_body={"prompt_logprobs": 2},
    ).choices[0]
    assert c.logprobs is None and c.text == PROMPTS[5] + plain.text
    null = client.completions.create(
        model=MODEL, prompt=PROMPTS[5], max_tokens=3, temperature=0, extra_body={"echo": None}
    ).choices[0]
    assert null.text == plain.text  # vLLM's Optional echo: null is no echo
    ref = _library(server, PROMPTS[5], 2, 3)
    assert len(plain.prompt_logprobs) == len(ref.prompt_token_ids)
    assert plain.prompt_logprobs[0] is None and plain.logprobs is None
    for got, rec in zip(plain.prompt_logprobs[1:], ref.prompt_logprobs[1:]):
        assert {int(t) for t in got} == set(rec)


def test_chat_prompt_logprobs_and_echo(client):
    """Chat: vLLM's response-level ``prompt_logprobs``; ``echo`` puts the last message's
    content first when it is the assistant's, streamed (in the opening chunk) or not."""
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    r = client.chat.completions.create(
        model=MODEL, messages=msgs, max_tokens=3, temperature=0, extra_body={"prompt_logprobs": 1}
    )
    assert len(r.prompt_logprobs) == r.usage.prompt_tokens and r.prompt_logprobs[0] is None
    e = client.chat.completions.create(
        model=MODEL, messages=msgs, max_tokens=3, temperature=0, extra_body={"echo": True}
    )
    assert e.choices[0].message.content == "Hello" + r.choices[0].message.content
    streamed = client.chat.completions.create(
        model=MODEL,
        messages=msgs,
        max_tokens=3,
        temperature=0,
        stream=True,
        extra_body={"echo": True},
    )
    assert "".join(ch.choices[0].delta.content or "" for ch in streamed if ch.choices) == (
        e.choices[0].message.content
    )
    user_last = [
        client.chat.completions.create(
            model=MODEL, messages=msgs[:1], max_tokens=3, temperature=0, extra_body={"echo": x}
        ).choices[0]
        for x in (True, False)
    ]
    assert user_last[0].message.content == user_last[1].message.content  # nothing echoed
