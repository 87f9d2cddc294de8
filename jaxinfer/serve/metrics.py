"""Prometheus metrics (vLLM's ``vllm:*`` as ``jaxinfer:*``), a registry per server; no JAX."""

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_LATENCY = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 60.0, 120.0)


class ServerMetrics:
    """Counters, histograms (`record`); gauges read from ``engine.stats()`` (`LLMEngine`)
    when scraped."""

    def __init__(self, engine) -> None:
        self.registry = r = CollectorRegistry()
        p = "jaxinfer:"
        self.requests = Counter(p + "request_success", "finished requests by finish reason",
                                ["finished_reason"], registry=r)
        self.prompt_tokens = Counter(p + "prompt_tokens", "prompt tokens of finished requests",
                                     registry=r)
        self.generation_tokens = Counter(p + "generation_tokens", "tokens generated",
                                         registry=r)
        self.ttft = Histogram(p + "time_to_first_token_seconds", "arrival to first token",
                              buckets=_LATENCY, registry=r)
        self.tpot = Histogram(p + "time_per_output_token_seconds", "mean time per output token "
                              "after the first, per request", buckets=_LATENCY, registry=r)
        self.e2e = Histogram(p + "e2e_request_latency_seconds", "arrival to finish",
                             buckets=_LATENCY, registry=r)
        for name, doc, field in (
                ("num_requests_running", "sequences holding KV pages", "num_running"),
                ("num_requests_waiting", "sequences waiting for admission", "num_waiting"),
                ("kv_pages_in_use", "KV pool pages not free", "kv_pages_in_use"),
                ("kv_pages_total", "usable KV pool pages", "kv_pages_total"),
                ("compiled_step_shapes", "step shapes compiled so far", "num_compiles"),
                ("prefix_cache_hit_rate", "prefix cache hit rate (tokens)",
                 "prefix_cache_hit_rate")):
            Gauge(p + name, doc, registry=r).set_function(
                lambda field=field: float(getattr(engine.stats(), field)))

    def record(self, out) -> None:
        """Count a finished `RequestOutput` (sample 0's finish reason and timings)."""
        first = out.outputs[0]
        self.requests.labels(first.finish_reason or "abort").inc()
        self.prompt_tokens.inc(len(out.prompt_token_ids))
        self.generation_tokens.inc(sum(len(c.token_ids) for c in out.outputs))
        m = out.metrics
        if m is None or m.first_token_time is None:
            return
        self.ttft.observe(m.ttft_s)
        if m.finish_time is not None:
            self.e2e.observe(m.finish_time - m.arrival_time)
            if len(first.token_ids) > 1:
                self.tpot.observe((m.finish_time - m.first_token_time) / (len(first.token_ids) - 1))
