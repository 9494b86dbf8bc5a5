"""`GET /metrics` of `gptforge serve`, in Prometheus' text format (prometheus_client, on a
registry of the app's own so that two apps in one process do not share counts).

Series: `gptforge_requests_total{endpoint,status}`, `gptforge_request_errors_total{endpoint,type}`,
`gptforge_prompt_tokens_total{model}`, `gptforge_generated_tokens_total{model}`, histograms
`gptforge_time_to_first_token_seconds{model}` (submission to the first generated token, queueing
and prefill included) and `gptforge_inter_token_latency_seconds{model}` (between a request's
consecutive tokens), gauges `gptforge_running_requests{model}` (rows in the batch) and
`gptforge_waiting_requests{model}` (requests without a token yet: queued or prefilling), and the
engine's prefill and prefix-cache counts: `gptforge_prefill_tokens_total{model}` (prompt tokens
computed), `gptforge_prefix_cache_query_tokens_total{model}` and
`gptforge_prefix_cache_hit_tokens_total{model}` (prompt tokens looked up, and found cached: their
ratio is the hit rate), `gptforge_prefix_cache_hit_rate{model}` and
`gptforge_prefix_cache_bytes{model}`; with `--speculate K`,
`gptforge_speculative_drafted_tokens_total{model}` and
`gptforge_speculative_accepted_tokens_total{model}` (their ratio is the acceptance rate).

With `--rag` (`serve.rag`): `gptforge_rag_requests_total{model}` (chat requests augmented),
histograms `gptforge_rag_retrieval_seconds{model}` (the index search) and
`gptforge_rag_fit_seconds{model}` (fitting the chunks into the context: rendering and tokenizing
candidate prompts), and `gptforge_rag_chunks_total{model,included}` (retrieved chunks by what
became of them: `whole`, `cut`, `dropped`).
"""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

__all__ = ["CONTENT_TYPE_LATEST", "ServeMetrics"]

_RETRIEVAL_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class ServeMetrics:
    def __init__(self):
        self.registry = r = CollectorRegistry()
        self.requests = Counter("gptforge_requests", "HTTP requests answered", ["endpoint", "status"], registry=r)
        self.errors = Counter(
            "gptforge_request_errors", "requests answered with an error object", ["endpoint", "type"], registry=r
        )
        self.prompt_tokens = Counter("gptforge_prompt_tokens", "prompt tokens prefilled", ["model"], registry=r)
        self.generated_tokens = Counter("gptforge_generated_tokens", "tokens generated", ["model"], registry=r)
        self.ttft = Histogram(
            "gptforge_time_to_first_token_seconds",
            "submission to first token",
            ["model"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "gptforge_inter_token_latency_seconds",
            "time between a request's tokens",
            ["model"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.running = Gauge("gptforge_running_requests", "requests in the decode batch", ["model"], registry=r)
        self.waiting = Gauge("gptforge_waiting_requests", "requests without a token yet", ["model"], registry=r)
        self.prefilled = Counter("gptforge_prefill_tokens", "prompt tokens computed", ["model"], registry=r)
        self.prefix_queries = Counter(
            "gptforge_prefix_cache_query_tokens", "prompt tokens looked up in the prefix cache", ["model"], registry=r
        )
        self.prefix_hits = Counter(
            "gptforge_prefix_cache_hit_tokens", "prompt tokens found in the prefix cache", ["model"], registry=r
        )
        self.prefix_hit_rate = Gauge(
            "gptforge_prefix_cache_hit_rate", "hit tokens / query tokens so far", ["model"], registry=r
        )
        self.prefix_bytes = Gauge("gptforge_prefix_cache_bytes", "bytes the prefix cache holds", ["model"], registry=r)
        self.drafted = Counter(
            "gptforge_speculative_drafted_tokens", "tokens drafted by prompt lookup", ["model"], registry=r
        )
        self.accepted = Counter(
            "gptforge_speculative_accepted_tokens", "drafted tokens the model kept", ["model"], registry=r
        )
        self.rag_requests = Counter(
            "gptforge_rag_requests", "chat requests augmented with retrieved chunks", ["model"], registry=r
        )
        self.rag_retrieval = Histogram(
            "gptforge_rag_retrieval_seconds",
            "index search per augmented request",
            ["model"],
            buckets=_RETRIEVAL_BUCKETS,
            registry=r,
        )
        self.rag_fit = Histogram(
            "gptforge_rag_fit_seconds",
            "fitting the chunks into the context",
            ["model"],
            buckets=_RETRIEVAL_BUCKETS,
            registry=r,
        )
        self.rag_chunks = Counter(
            "gptforge_rag_chunks", "retrieved chunks by what became of them", ["model", "included"], registry=r
        )
        self._seen: dict[str, tuple[int, int, int]] = {}  # the engine's running totals at the last render

    def observer(self, model: str):
        """The engine's `observe` callback for `model`: token counts and latencies."""
        generated, ttft, itl = (self.generated_tokens.labels(model), self.ttft.labels(model), self.itl.labels(model))

        def observe(request, event) -> None:
            if event.finish_reason is not None:
                return
            times = request.token_times
            generated.inc()
            if len(times) == 1:
                ttft.observe(times[0] - request.submitted)
            else:
                itl.observe(times[-1] - times[-2])

        return observe

    def observe_rag(self, model: str, search_s: float, fit_s: float, sources: list[dict]) -> None:
        """One augmented chat request (serve.rag): its times and its chunks' fates."""
        self.rag_requests.labels(model).inc()
        self.rag_retrieval.labels(model).observe(search_s)
        self.rag_fit.labels(model).observe(fit_s)
        for source in sources:
            self.rag_chunks.labels(model, source["included"]).inc()

    def render(self, engines: dict) -> bytes:
        for name, engine in engines.items():
            self.running.labels(name).set(engine.busy_slots)
            self.waiting.labels(name).set(engine.waiting)
            st = engine.stats  # totals since the engine started: the counters grow by the difference
            now = (
                st.prefilled_tokens,
                st.prefix_query_tokens,
                st.prefix_hit_tokens,
                st.drafted_tokens,
                st.accepted_tokens,
            )
            before = self._seen.get(name, (0,) * len(now))
            counters = (self.prefilled, self.prefix_queries, self.prefix_hits, self.drafted, self.accepted)
            for counter, a, b in zip(counters, now, before):
                if a > b:
                    counter.labels(name).inc(a - b)
            self._seen[name] = now
            self.prefix_hit_rate.labels(name).set(
                st.prefix_hit_tokens / st.prefix_query_tokens if st.prefix_query_tokens else 0.0
            )
            self.prefix_bytes.labels(name).set(st.prefix_cache_bytes)
        return generate_latest(self.registry)
