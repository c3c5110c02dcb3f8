"""Prometheus metrics of one server: a private registry, the metric objects, and a small API the server calls.

Usage from the server (every call is cheap, thread-safe and never raises):

    metrics = ServerMetrics()                    # one per Server; own CollectorRegistry (several servers per process ok)
    metrics.blocks_served(end - start)           # after loading blocks
    metrics.set_cache(used_bytes, free_bytes)    # after each KV allocation / free (the pool's bytes)
    metrics.set_prefix_cache(cached_bytes, evictions)  # with it: the prefix cache's pages and evictions so far
    metrics.prefix_probe(keyed_tokens=, hit_tokens=)   # a session's first step asked for its prefix
    with metrics.session():                      # around one open session (the core's `SpanCore.open_session`)
        metrics.queue_wait(seconds)              # time a task waited in the runtime queue
        metrics.observe_step(seconds)            # time the runtime spent executing one task
        metrics.batch_size(n)                    # sessions/rows merged into that executed task
        metrics.tokens("inference", n)           # tokens processed; kind in {"inference", "forward", "backward"}
    metrics.rejected("cache_full")               # a request refused; reason in REJECT_REASONS (others -> "other")
    metrics.announce_failed()                    # a DHT declare that failed or timed out
    metrics.span_loaded(seconds)                 # a span finished loading (at start and after each move)
    metrics.move_started()                       # the swarm policy decided to move this server
    metrics.tokens_total()                       # tokens processed so far, every kind (read back for announcements)
    exporter = metrics.serve(port)               # HTTP exporter at http://127.0.0.1:<port>/metrics; exporter.close()

Names exported (prefix `corolla_`): sessions_active, sessions_opened_total, tokens_processed_total{kind},
step_seconds, queue_wait_seconds, batch_size (histograms), requests_rejected_total{reason},
kv_cache_used_bytes, kv_cache_free_bytes, prefix_keyed_tokens_total, prefix_hit_tokens_total, prefix_cache_bytes,
prefix_cache_evictions, prefix_cache_limit_bytes, blocks_served, announce_failures_total, moves_total,
span_load_seconds_total, span_loads_total.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest, start_http_server

from corolla.utils.logging import get_logger

logger = get_logger(__name__)

TOKEN_KINDS = ("inference", "forward", "backward")
# every reason label a fair-use limit can produce (`core.limits`: its exceptions' `reason`)
LIMIT_REASONS = (
    "peer_sessions",
    "sessions_full",
    "peer_kv",
    "peer_stream_bytes",
    "stream_bytes_full",
    "stream_message_too_big",
    "stream_stalled",
    "evicted",
    "duplicate_step",
)
# the direct port's refused connections (`direct_endpoint`): too many before their hello, no hello, a bad hello or
# ticket, a peer past its connection share
DIRECT_REASONS = ("direct_pending", "direct_no_hello", "direct_bad_hello", "direct_connections")
REJECT_REASONS = (
    "bad_request", "cache_full", "too_long", "overloaded", "timeout", "draining", *LIMIT_REASONS, *DIRECT_REASONS,
    "other",
)  # fmt: skip

# Decode steps on CPU take ~1 ms to ~1 s; on GPU ~0.1-50 ms. Exponential buckets cover both.
_LATENCY_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


@dataclass
class MetricsExporter:
    """A running HTTP exporter; `close()` stops it (idempotent)."""

    host: str
    port: int
    _server: WSGIServer
    _thread: threading.Thread

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/metrics"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


class ServerMetrics:
    """The metrics of one server process, kept in their own `CollectorRegistry`."""

    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        r = self.registry
        self._sessions_active = Gauge("corolla_sessions_active", "Inference sessions open now", registry=r)
        self._sessions_opened = Counter("corolla_sessions_opened", "Inference sessions opened", registry=r)
        self._tokens = Counter(
            "corolla_tokens_processed", "Tokens processed by the served blocks, by kind", ["kind"], registry=r
        )
        self._step = Histogram(
            "corolla_step_seconds", "Time the runtime spent executing one task", buckets=_LATENCY_BUCKETS_S, registry=r
        )
        self._queue_wait = Histogram(
            "corolla_queue_wait_seconds", "Time a task waited before execution", buckets=_LATENCY_BUCKETS_S, registry=r
        )
        self._batch = Histogram(
            "corolla_batch_size", "Sessions or rows merged into one executed task", buckets=_BATCH_BUCKETS, registry=r
        )
        self._rejected = Counter("corolla_requests_rejected", "Requests refused, by reason", ["reason"], registry=r)
        self._cache_used = Gauge("corolla_kv_cache_used_bytes", "KV cache bytes allocated", registry=r)
        self._cache_free = Gauge("corolla_kv_cache_free_bytes", "KV cache bytes still free", registry=r)
        self._prefix_keyed = Counter(
            "corolla_prefix_keyed_tokens", "Positions sessions named by prefix keys when they opened", registry=r
        )
        self._prefix_hits = Counter(
            "corolla_prefix_hit_tokens", "Positions sessions reused from the prefix cache when they opened", registry=r
        )
        self._prefix_bytes = Gauge(
            "corolla_prefix_cache_bytes", "KV bytes of the cached prefix pages (held by sessions or idle)", registry=r
        )
        self._prefix_evictions = Gauge(
            "corolla_prefix_cache_evictions",
            "Cached prefix pages evicted so far (for new sessions or past the operator's cap)",
            registry=r,
        )
        self._prefix_limit = Gauge(
            "corolla_prefix_cache_limit_bytes",
            "The operator's cap on cached prefix pages no session holds (--prefix_cache_tokens; -1: none)",
            registry=r,
        )
        self._blocks = Gauge("corolla_blocks_served", "Transformer blocks this server holds", registry=r)
        self._serving_path = Gauge(
            "corolla_serving_path",
            "1 for how the engine runs this span (fused kernels or eager blocks)",
            ["path"],
            registry=r,
        )
        self._announce_failures = Counter(
            "corolla_announce_failures", "DHT announcements that failed or timed out", registry=r
        )
        self._moves = Counter("corolla_moves", "Rebalancing moves the swarm policy decided", registry=r)
        self._load_seconds = Counter(
            "corolla_span_load_seconds", "Seconds spent loading spans (joining and moves)", registry=r
        )
        self._loads = Counter("corolla_span_loads", "Spans loaded (joining and moves)", registry=r)
        # Pre-create labelled children so every series is exported (as 0) from the start.
        # kept: labels() looks a child up under a lock each call (~7 us; a decode step counts its tokens)
        self._token_series = {kind: self._tokens.labels(kind=kind) for kind in TOKEN_KINDS}
        for reason in REJECT_REASONS:
            self._rejected.labels(reason=reason)

    # --- sessions ---
    def session_opened(self) -> None:
        self._sessions_opened.inc()
        self._sessions_active.inc()

    def session_closed(self) -> None:
        self._sessions_active.dec()

    @contextlib.contextmanager
    def session(self) -> Iterator[None]:
        """Counts one open session for the duration of the block, on every exit path."""
        self.session_opened()
        try:
            yield
        finally:
            self.session_closed()

    # --- work ---
    def tokens(self, kind: str, n: int) -> None:
        series = self._token_series.get(kind)
        if series is None:
            raise ValueError(f"token kind must be one of {TOKEN_KINDS}, got {kind!r}")
        if n < 0:
            raise ValueError(f"token count must be >= 0, got {n}")
        series.inc(n)

    def observe_step(self, seconds: float) -> None:
        self._step.observe(max(0.0, seconds))

    def queue_wait(self, seconds: float) -> None:
        self._queue_wait.observe(max(0.0, seconds))

    def batch_size(self, n: int) -> None:
        self._batch.observe(n)

    def rejected(self, reason: str) -> None:
        self._rejected.labels(reason=reason if reason in REJECT_REASONS else "other").inc()

    # --- resources and lifecycle ---
    def set_cache(self, used_bytes: int, free_bytes: int) -> None:
        self._cache_used.set(used_bytes)
        self._cache_free.set(free_bytes)

    def set_prefix_cache(self, cached_bytes: int, evictions: int, limit_bytes: int | None = None) -> None:
        """`limit_bytes`: the operator's cap on idle cached pages (None: no cap but the KV cache; reported as -1)."""
        self._prefix_bytes.set(cached_bytes)
        self._prefix_evictions.set(evictions)
        self._prefix_limit.set(-1 if limit_bytes is None else limit_bytes)

    def prefix_probe(self, *, keyed_tokens: int, hit_tokens: int) -> None:
        """A session's first step named `keyed_tokens` positions by prefix keys and reused `hit_tokens` of them."""
        self._prefix_keyed.inc(max(0, keyed_tokens))
        self._prefix_hits.inc(max(0, hit_tokens))

    def blocks_served(self, n: int) -> None:
        self._blocks.set(n)

    def serving_path(self, path: str) -> None:
        """Marks `path` (fused or eager) as the one serving now: 1 for it, 0 for the other."""
        for name in ("fused", "eager"):
            self._serving_path.labels(path=name).set(1 if name == path else 0)

    def announce_failed(self) -> None:
        self._announce_failures.inc()

    def span_loaded(self, seconds: float) -> None:
        self._loads.inc()
        self._load_seconds.inc(max(0.0, seconds))

    def move_started(self) -> None:
        self._moves.inc()

    def tokens_total(self) -> int:
        """Tokens processed so far, every kind."""
        samples = (sample for family in self._tokens.collect() for sample in family.samples)
        return int(sum(sample.value for sample in samples if sample.name.endswith("_total")))

    # --- export ---
    def render(self) -> bytes:
        """The text exposition format (what `/metrics` returns)."""
        return generate_latest(self.registry)

    def serve(self, port: int, host: str = "127.0.0.1") -> MetricsExporter:
        """Starts an HTTP exporter thread at `http://host:port/metrics` (port 0 picks a free port)."""
        server, thread = start_http_server(port, addr=host, registry=self.registry)
        bound_port = server.server_address[1]
        logger.info(f"metrics.serve(url=http://{host}:{bound_port}/metrics)")
        return MetricsExporter(host=host, port=bound_port, _server=server, _thread=thread)
