"""Prometheus metrics of one `corolla-api` gateway (its own registry, rendered at `/metrics`).

Names (prefix `corolla_api_`): `requests_total{endpoint,status}` (HTTP status of every generation request),
`prompt_tokens_total`, `generation_tokens_total`, `time_to_first_token_seconds` and `inter_token_latency_seconds`
(histograms, the same quantities as vLLM's `vllm:time_to_first_token_seconds` / `vllm:inter_token_latency_seconds`),
`requests_running` (generations in progress).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# A swarm's first token takes ~10 ms (local) to tens of seconds (a long prompt over the internet).
_TTFT_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
_ITL_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class ApiMetrics:
    """Every method is cheap, thread-safe and never raises."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self._requests = Counter(
            "corolla_api_requests",
            "Generation requests by endpoint and HTTP status",
            ["endpoint", "status"],
            registry=self.registry,
        )
        self._prompt_tokens = Counter("corolla_api_prompt_tokens", "Prompt tokens prefilled", registry=self.registry)
        self._generation_tokens = Counter("corolla_api_generation_tokens", "Tokens generated", registry=self.registry)
        self._ttft = Histogram(
            "corolla_api_time_to_first_token_seconds",
            "From the request's start of generation to its first token",
            buckets=_TTFT_BUCKETS_S,
            registry=self.registry,
        )
        self._itl = Histogram(
            "corolla_api_inter_token_latency_seconds",
            "Between two consecutive tokens of one sequence",
            buckets=_ITL_BUCKETS_S,
            registry=self.registry,
        )
        self._running = Gauge("corolla_api_requests_running", "Generations in progress", registry=self.registry)

    def request(self, endpoint: str, status: int) -> None:
        self._requests.labels(endpoint=endpoint, status=str(status)).inc()

    def prompt_tokens(self, n: int) -> None:
        self._prompt_tokens.inc(n)

    def token(self, *, first: bool, since_s: float | None) -> None:
        """One generated token; `since_s` is the time since the request started (first) or since the last token
        (None: count it only, e.g. the first token of a request's second choice)."""
        self._generation_tokens.inc()
        if since_s is not None:
            (self._ttft if first else self._itl).observe(max(since_s, 0.0))

    def running(self, delta: int) -> None:
        self._running.inc(delta)

    def render(self) -> bytes:
        return generate_latest(self.registry)
