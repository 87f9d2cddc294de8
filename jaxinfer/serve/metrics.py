"""Prometheus metrics (vLLM's ``vllm:*`` as ``jaxinfer:*``), a registry per server; no JAX."""

import functools

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily

_LATENCY = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 60.0, 120.0)
_SPEC = (  # jaxinfer:spec_decode_NAME (vLLM's vllm:spec_decode_NAME), its help, its stats field
    ("num_drafts", "rows verified with at least one draft token", "spec_num_drafts"),
    ("num_draft_tokens", "draft tokens verified", "spec_num_draft_tokens"),
    ("num_accepted_tokens", "draft tokens accepted", "spec_num_accepted_tokens"),
)
PER_POS = "spec_accepted_per_pos."  # + position: a `core.engine_stats` key


class SpecDecodeCollector:
    """vLLM's speculative-decoding counters as ``jaxinfer:spec_decode_*``, read from
    ``client.stats`` when scraped: three counters (zero without speculation) and
    ``jaxinfer:spec_decode_num_accepted_tokens_per_pos`` labelled ``position`` (0..k-1; no
    sample without speculation)."""

    def __init__(self, client) -> None:
        self.client = client

    def collect(self):
        stats = self.client.stats
        for name, doc, field in _SPEC:
            yield CounterMetricFamily("jaxinfer:spec_decode_" + name, doc, value=stats[field])
        per_pos = CounterMetricFamily(
            "jaxinfer:spec_decode_num_accepted_tokens_per_pos",
            "draft tokens accepted at each draft position",
            labels=["position"],
        )
        for pos, n in sorted(
            (int(k[len(PER_POS) :]), v) for k, v in stats.items() if k.startswith(PER_POS)
        ):
            per_pos.add_metric([str(pos)], n)
        yield per_pos


class ServerMetrics:
    """Counters, histograms (`record`); gauges and the `SpecDecodeCollector` counters read from
    ``client.stats`` (the engine core's latest `core.engine_stats`, an `EngineCoreClient`'s)
    when scraped."""

    def __init__(self, client) -> None:
        self.registry = r = CollectorRegistry()
        p, hist = "jaxinfer:", functools.partial(Histogram, buckets=_LATENCY, registry=r)
        self.requests = Counter(
            p + "request_success",
            "finished requests by finish reason",
            ["finished_reason"],
            registry=r,
        )
        self.prompt_tokens = Counter(
            p + "prompt_tokens", "prompt tokens of finished requests", registry=r
        )
        self.generation_tokens = Counter(p + "generation_tokens", "tokens generated", registry=r)
        self.ttft = hist(p + "time_to_first_token_seconds", "arrival to first token")
        self.tpot = hist(
            p + "time_per_output_token_seconds",
            "mean time per output token after the first, per request",
        )
        self.e2e = hist(p + "e2e_request_latency_seconds", "arrival to finish")
        for name, doc, field in (
            ("num_requests_running", "sequences holding KV pages", "num_running"),
            ("num_requests_waiting", "sequences waiting for admission", "num_waiting"),
            ("kv_pages_in_use", "KV pool pages not free", "kv_pages_in_use"),
            ("kv_pages_total", "usable KV pool pages", "kv_pages_total"),
            ("compiled_step_shapes", "step shapes compiled so far", "num_compiles"),
            ("lazy_compiles", "programs compiled in a step (after start-up)", "num_lazy_compiles"),
            ("prefix_cache_hit_rate", "prefix cache hit rate (tokens)", "prefix_cache_hit_rate"),
        ):
            Gauge(p + name, doc, registry=r).set_function(
                lambda field=field: float(client.stats[field])
            )
        r.register(SpecDecodeCollector(client))

    def record(self, seqs) -> None:
        """Count a finished request from its samples' `Sequence`s (per-sample token counts;
        sample 0's finish reason and timings, ``time.perf_counter`` seconds)."""
        first = seqs[0]
        self.requests.labels(first.finish_reason or "abort").inc()
        self.prompt_tokens.inc(first.num_prompt_tokens)
        self.generation_tokens.inc(sum(s.num_output_tokens for s in seqs))
        if first.first_token_time is None:
            return
        self.ttft.observe(first.first_token_time - first.arrival_time)
        if first.finish_time is not None:
            self.e2e.observe(first.finish_time - first.arrival_time)
            if (n := first.num_output_tokens) > 1:
                self.tpot.observe((first.finish_time - first.first_token_time) / (n - 1))
