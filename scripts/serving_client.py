"""The clients of bench_serving.py: one streamed completion with its timings (`one`), a timed run
of Poisson arrivals at one rate (`run_rate`, over one or several client processes), the soak
(`soak`: disconnecting and malformed requests, resident memory), and the server's metrics."""

from __future__ import annotations

import asyncio
import random
import time
import urllib.request

import numpy as np

MODEL = "bench"  # the served model name


async def one(client, prompt, max_tokens: int, t_send: float, close_after: int | None = None):
    """Stream one completion at ``t_send`` (perf_counter); its timings, or None if left."""
    await asyncio.sleep(max(0.0, t_send - time.perf_counter()))
    t0 = time.perf_counter()
    stream = await client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0.0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    times, usage = [], None
    async for chunk in stream:
        if chunk.choices:
            times.append(time.perf_counter())
            if close_after is not None and len(times) >= close_after:
                await stream.close()
                return None
        usage = chunk.usage or usage
    n = usage.completion_tokens if usage else 0
    return dict(
        start=t0,
        ttft=times[0] - t0,
        latency=times[-1] - t0,
        tokens=n,
        itl=np.diff(times).tolist(),
        ok=n == max_tokens,
    )


def metric(url: str, name: str) -> float:
    text = urllib.request.urlopen(url.rsplit("/v1", 1)[0] + "/metrics").read().decode()
    return sum(
        float(line.split()[-1]) for line in text.splitlines() if line.startswith(f"jaxinfer:{name}")
    )


async def client_part(url, items) -> list:
    """Stream ``items`` ((prompt, max_tokens, perf_counter send time)) on one asyncio client."""
    import openai

    client = openai.AsyncOpenAI(base_url=url, api_key="none", max_retries=0, timeout=3600)
    res = await asyncio.gather(*(one(client, p, m, t) for p, m, t in items))
    await client.close()
    return res


def run_part(url, items) -> list:
    return asyncio.run(client_part(url, items))


def run_rate(url, prompts, out_lens, rate: float, seed: int, procs: int = 1) -> dict:
    """One timed run at ``rate``; with ``procs`` > 1 the requests are dealt round-robin to that
    many client processes (perf_counter is the system's monotonic clock, shared by them), so
    that one Python client's chunk parsing does not bound what is measured."""
    gaps = (
        np.random.default_rng(seed).exponential(1 / rate, len(prompts))
        if rate < np.inf
        else np.zeros(len(prompts))
    )
    if procs > 1:
        import concurrent.futures
        import multiprocessing

        pool = concurrent.futures.ProcessPoolExecutor(
            procs, mp_context=multiprocessing.get_context("spawn")
        )
        list(pool.map(time.sleep, [0.5] * procs))  # the workers started and imported
    t0 = time.perf_counter() + 0.05
    sends = t0 + np.cumsum(gaps) - gaps[0]
    items = list(zip(prompts, out_lens, sends))
    if procs > 1:
        with pool:
            parts = list(pool.map(run_part, [url] * procs, [items[i::procs] for i in range(procs)]))
        res = [r for part in parts for r in part]
    else:
        res = run_part(url, items)
    dur = max(r["start"] + r["latency"] for r in res) - t0
    pct = lambda xs, q: float(np.percentile(xs, q)) if len(xs) else None
    ttft, itl = [r["ttft"] for r in res], [g for r in res for g in r["itl"]]
    tpot = [(r["latency"] - r["ttft"]) / (r["tokens"] - 1) for r in res if r["tokens"] > 1]
    row = dict(
        rate=rate if rate < np.inf else "inf",
        duration_s=dur,
        request_throughput=len(res) / dur,
        output_tok_s=sum(r["tokens"] for r in res) / dur,
        incomplete=sum(not r["ok"] for r in res),
    )
    for name, xs in (("ttft", ttft), ("tpot", tpot), ("itl", itl)):
        row.update(
            {
                f"{name}_mean_ms": float(np.mean(xs)) * 1e3 if xs else None,
                f"{name}_p50_ms": (pct(xs, 50) or 0) * 1e3,
                f"{name}_p99_ms": (pct(xs, 99) or 0) * 1e3,
            }
        )
    return row


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS"))


async def soak(args, url, child, prompts, out_lens) -> dict:
    """Poisson arrivals of ``--soak-requests`` good, disconnecting and malformed requests."""
    import openai

    client = openai.AsyncOpenAI(base_url=url, api_key="none", max_retries=0, timeout=3600)
    rng, n = random.Random(args.seed), args.soak_requests
    kinds = rng.choices(["good", "leave", "bad"], [0.85, 0.10, 0.05], k=n)
    gaps = np.random.default_rng(args.seed).exponential(args.soak_seconds / n, n)
    t0 = time.perf_counter()
    sends = t0 + np.cumsum(gaps)
    host, port = url.split("//")[1].split("/")[0].split(":")
    bad_bodies = [
        b"{",
        b'{"prompt": "x", "temperature": -1}',
        b'{"prompt": [1], "n": 0}',
        b'{"prompt": "\xff"}',
        b'{"max_tokens": 3}',
    ]

    async def bad(t_send):
        await asyncio.sleep(max(0.0, t_send - time.perf_counter()))
        r, w = await asyncio.open_connection(host, int(port))
        body = rng.choice(bad_bodies)
        w.write(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
        )
        status = int((await r.read()).split(b" ", 2)[1])
        w.close()
        return status

    async def job(i):
        p, m = prompts[i % len(prompts)], out_lens[i % len(prompts)]
        if kinds[i] == "bad":
            return await bad(sends[i])
        return await one(
            client, p, m, sends[i], rng.randint(1, max(1, m - 1)) if kinds[i] == "leave" else None
        )

    warm = max(1, n // 10)
    first = await asyncio.gather(*(job(i) for i in range(warm)))
    rss_warm = rss_bytes(child.pid)
    rest = await asyncio.gather(*(job(i) for i in range(warm, n)))
    await client.close()
    rss_end = rss_bytes(child.pid)
    res = first + rest
    good = [r for r, k in zip(res, kinds) if k == "good"]
    return dict(
        requests=n,
        good=len(good),
        lost=sum(not r["ok"] for r in good),
        bad=kinds.count("bad"),
        bad_not_4xx=sum(not 400 <= r < 500 for r, k in zip(res, kinds) if k == "bad"),
        disconnects=kinds.count("leave"),
        seconds=time.perf_counter() - t0,
        rss_after_warmup_mb=rss_warm / 2**20,
        rss_end_mb=rss_end / 2**20,
        rss_growth=rss_end / rss_warm - 1,
    )
