"""`GET /metrics` of `gptforge serve`, in Prometheus' text format (prometheus_client, on a
registry of the app's own so that two apps in one process do not share counts).

Series: `gptforge_requests_total{endpoint,status}`, `gptforge_request_errors_total{endpoint,type}`,
`gptforge_prompt_tokens_total{model}`, `gptforge_generated_tokens_total{model}`, histograms
`gptforge_time_to_first_token_seconds{model}` (submission to the first generated token, queueing
and prefill included) and `gptforge_inter_token_latency_seconds{model}` (between a request's
consecutive tokens), and gauges `gptforge_running_requests{model}` (rows in the batch) and
`gptforge_waiting_requests{model}` (the queue).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST

__all__ = ["CONTENT_TYPE_LATEST", "ServeMetrics"]

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class ServeMetrics:
    def __init__(self):
        self.registry = r = CollectorRegistry()
        self.requests = Counter("gptforge_requests", "HTTP requests answered", ["endpoint", "status"], registry=r)
        self.errors = Counter("gptforge_request_errors", "requests answered with an error object",
                              ["endpoint", "type"], registry=r)
        self.prompt_tokens = Counter("gptforge_prompt_tokens", "prompt tokens prefilled", ["model"], registry=r)
        self.generated_tokens = Counter("gptforge_generated_tokens", "tokens generated", ["model"], registry=r)
        self.ttft = Histogram("gptforge_time_to_first_token_seconds", "submission to first token", ["model"],
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("gptforge_inter_token_latency_seconds", "time between a request's tokens", ["model"],
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.running = Gauge("gptforge_running_requests", "requests in the decode batch", ["model"], registry=r)
        self.waiting = Gauge("gptforge_waiting_requests", "requests in the queue", ["model"], registry=r)

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

    def render(self, engines: dict) -> bytes:
        for name, engine in engines.items():
            self.running.labels(name).set(engine.busy_slots)
            self.waiting.labels(name).set(len(engine.waiting))
        return generate_latest(self.registry)
