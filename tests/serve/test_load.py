"""The server under concurrent load with the official ``openai`` async client (issue 19 items
2-4, scaled for the CPU): 200 concurrent streams; clients that disconnect mid-stream; malformed
bodies mixed into normal traffic. Greedy outputs are compared with `LLM.generate` on the same
engine, run while the server is idle.

A CI timeout's SIGTERM: nothing here catches it (uvicorn runs in a thread, so it installs no
handler; asyncio.run only takes SIGINT), so it kills pytest, unless pytest is the first process
of its PID namespace (a container's command), where the kernel drops signals it has no handler
for and only SIGKILL works. While the server is up, conftest.py's handler turns SIGTERM into a
KeyboardInterrupt (pytest tears the server down and stops; an Exception would be kept by
``gather(return_exceptions=True)``), and exits hard if that takes over 30 s."""

import asyncio
import json
import random

import pytest

openai = pytest.importorskip("openai")  # the GPU machine has no openai client

from jaxinfer import SamplingParams

from .conftest import KEY, MODEL, PROMPTS

pytestmark = pytest.mark.slow


def _requests(n: int, seed: int, greedy_every: int = 3, tokens: tuple[int, int] = (4, 16)):
    """(prompt, max_tokens, sampling kwargs): 1-3 prompts joined, max_tokens in ``tokens``, every
    ``greedy_every``-th greedy, the others sampled (seeded) with mixed top_p / top_k / min_p."""
    rng, out = random.Random(seed), []
    for i in range(n):
        prompt = " ".join(rng.sample(PROMPTS, rng.randint(1, 3)))
        samp = (
            dict(temperature=0.0)
            if i % greedy_every == 0
            else dict(
                temperature=rng.choice([0.7, 1.0]),
                top_p=rng.choice([1.0, 0.9]),
                seed=rng.randrange(10**6),
                extra_body={"top_k": rng.choice([-1, 20]), "min_p": rng.choice([0.0, 0.05])},
            )
        )
        out.append((prompt, rng.randint(*tokens), samp))
    return out


def _references(server, reqs) -> dict[int, str]:
    """Greedy texts from `LLM.generate` (the engine thread is idle: nothing else steps it)."""
    idx = [i for i, r in enumerate(reqs) if r[2]["temperature"] == 0]
    outs = server.llm.generate(
        [reqs[i][0] for i in idx],
        [SamplingParams(temperature=0, max_tokens=reqs[i][1], ignore_eos=True) for i in idx],
    )
    return {i: o.text for i, o in zip(idx, outs)}


async def _stream(ac, prompt, max_tokens, samp, close_after: int | None = None):
    """(text, usage) of one streamed completion; ``close_after`` chunks: disconnect, None."""
    extra = {"ignore_eos": True, **samp.get("extra_body", {})}
    kw = {k: v for k, v in samp.items() if k != "extra_body"}
    s = await ac.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=max_tokens,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=extra,
        **kw,
    )
    text, usage, n = "", None, 0
    if close_after == 0:
        await s.close()
        return None
    async for c in s:
        if c.choices:
            text, n = text + c.choices[0].text, n + 1
        usage = c.usage or usage
        if close_after is not None and n >= close_after:
            await s.close()
            return None
    return text, usage


def _client(server):
    """The last of 200 queued streams waits for every stream ahead of it: a generous read
    timeout (30 minutes) keeps a slow CI machine from failing it."""
    return openai.AsyncOpenAI(base_url=server.url, api_key=KEY, max_retries=0, timeout=1800)


def _metric(server, name, **labels) -> float:
    metric = getattr(server.app.state.metrics, name)
    return (metric.labels(**labels) if labels else metric)._value.get()


def test_200_concurrent_streams(server, wait_idle):
    # 2-6 tokens a stream: the 200 streams are still open at once (32 rows run, the others queue)
    reqs = _requests(200, seed=0, tokens=(2, 6))
    wait_idle(server)
    refs = _references(server, reqs)

    async def run():
        ac = _client(server)
        return await asyncio.gather(*(_stream(ac, *r) for r in reqs), return_exceptions=True)

    results = asyncio.run(run())
    assert not [r for r in results if isinstance(r, BaseException)], [
        r for r in results if isinstance(r, BaseException)
    ][:3]
    for (_, max_tokens, _), (_text, usage) in zip(reqs, results):
        assert usage.completion_tokens == max_tokens
    assert {i: results[i][0] for i in refs} == refs
    wait_idle(server)


def test_disconnects_do_not_change_the_others(server, wait_idle):
    normal = _requests(50, seed=1, greedy_every=1)
    leaving = [(p, max(m, 10), s) for p, m, s in _requests(50, seed=2)]
    wait_idle(server)
    refs = _references(server, normal)
    aborted = _metric(server, "requests", finished_reason="abort")
    rng = random.Random(3)

    async def run():
        ac = _client(server)
        jobs = [_stream(ac, *r) for r in normal] + [
            _stream(ac, *r, close_after=rng.randint(0, 4)) for r in leaving
        ]
        order = rng.sample(range(len(jobs)), len(jobs))  # interleave the two kinds
        res = await asyncio.gather(*(jobs[i] for i in order), return_exceptions=True)
        return [res[order.index(i)] for i in range(len(jobs))]

    results = asyncio.run(run())
    assert not [r for r in results if isinstance(r, BaseException)]
    assert {i: results[i][0] for i in range(50)} == refs
    # joined chunks (a slow reader gets fewer, longer ones) can end a stream before it leaves
    assert all(
        r is None or r[1].completion_tokens == m for r, (_, m, _) in zip(results[50:], leaving)
    )
    wait_idle(server)  # every page is back
    assert _metric(server, "requests", finished_reason="abort") - aborted >= 25


def _malformed(rng: random.Random) -> bytes:
    return rng.choice(
        [
            b"{",
            b"",
            b"null",
            b"[1, 2]",
            b'{"prompt": "\xff\xfe\xfd"}',
            b'{"prompt": 5}',
            b'{"prompt": "x", "max_tokens": "many"}',
            b'{"prompt": "x", "max_tokens": 1e400}',
            b'{"prompt": "x", "temperature": 1e309}',
            b'{"prompt": "x", "n": 100000}',
            b'{"max_tokens": 5}',
            b'{"prompt": "x", "stop": [1, 2]}',
            b'{"prompt": [-1]}',
            b'{"prompt": "x", "logit_bias": {"a": 1}}',
            b'{"prompt": "x", "seed": 1e30}',
            b'{"prompt": "x", "top_k": -5}',
            b'{"prompt": "x", "model": "other"}',
            b'{"prompt": "x", "max_tokens": 99999999999999999999999}',
            b'{"prompt": "' + "\u00e9".encode() * 200 + b'"}',
            b'{"prompt": {"a": 1}}',
        ]
    )


def test_malformed_bodies_mixed_into_load(server, raw, wait_idle):
    normal = _requests(40, seed=4, greedy_every=1)
    wait_idle(server)
    refs = _references(server, normal)
    rng = random.Random(5)
    bodies = [_malformed(rng) for _ in range(98)] + [
        b'{"prompt": "' + b"ab " * ((10 << 20) // 3) + b'"}'
    ] * 2

    async def run():
        ac = _client(server)
        return await asyncio.gather(
            *(_stream(ac, *r) for r in normal), *(raw(server.port, b) for b in bodies)
        )

    results = asyncio.run(run())
    assert {i: results[i][0] for i in range(40)} == refs
    statuses = [status for status, _ in results[40:]]
    assert all(s in (400, 404, 413) for s in statuses), statuses
    for _, payload in results[40:]:
        assert json.loads(payload)["error"]["message"]
    wait_idle(server)
