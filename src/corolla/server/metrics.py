"""Prometheus metrics of one server: a private registry, the metric objects (prefix `corolla_`) and the calls the server
makes on events, each cheap, thread-safe and never raising. Nothing runs per decode step: the runtime and the engine
count in place and a scrape reads them (`read_work`); a replaced source adds its totals to those kept."""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from itertools import accumulate
from typing import Protocol
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest, start_http_server
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric

from corolla.server.core.batch_counts import BATCH_SECONDS_BOUNDS, BATCH_STEPS_BOUNDS, BatchCounts
from corolla.utils.logging import get_logger

logger = get_logger(__name__)

TOKEN_KINDS = ("inference", "forward", "backward")
# every reason label a fair-use limit can produce (`core.limits`: its exceptions' `reason`)
LIMIT_REASONS = (
    "peer_sessions",
    "sessions_full",
    "peer_kv",
    "peer_stream_bytes",
    "peer_opening_streams",
    "stream_bytes_full",
    "stream_message_too_big",
    "peer_import_bytes",
    "import_bytes_full",
    "stream_stalled",
    "stream_too_slow",
    "reply_stalled",
    "evicted",
    "duplicate_step",
)
# the direct port's refused connections (`direct_endpoint`): too many before their hello, no hello, a bad hello or
# ticket, a good ticket without the proof of its key (a hello resent by someone who saw it), a peer past its
# connection share
DIRECT_REASONS = ("direct_pending", "direct_no_hello", "direct_bad_hello", "direct_bad_proof", "direct_connections")
REJECT_REASONS = (
    "bad_request", "cache_full", "too_long", "overloaded", "timeout", "draining", *LIMIT_REASONS, *DIRECT_REASONS,
    "other",
)  # fmt: skip


class WorkSource(Protocol):
    """What the metrics read when scraped (the engine executor): its runtime's batches and the inference tokens
    its engine ran, both counted in place by the threads that do the work."""

    def batch_counts(self) -> BatchCounts: ...

    @property
    def inference_tokens(self) -> int: ...


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
        counter, gauge = functools.partial(Counter, registry=r), functools.partial(Gauge, registry=r)
        self._sessions_active = gauge("corolla_sessions_active", "Inference sessions open now")
        self._sessions_opened = counter("corolla_sessions_opened", "Inference sessions opened")
        self._queue_wait = Histogram("corolla_queue_wait_seconds", "Time a task waited before execution",
                                     buckets=BATCH_SECONDS_BOUNDS, registry=r)  # fmt: skip
        self._lock = threading.Lock()
        self._task_tokens = dict.fromkeys(TOKEN_KINDS, 0)  # `tokens()`: counted per task, not per decode step
        self._source: WorkSource | None = None
        self._retired = BatchCounts()  # the totals of replaced sources
        self._retired_tokens = 0
        self._rejected = counter("corolla_requests_rejected", "Requests refused, by reason", ["reason"])
        self._cache_used = gauge("corolla_kv_cache_used_bytes", "KV cache bytes allocated")
        self._cache_free = gauge("corolla_kv_cache_free_bytes", "KV cache bytes still free")
        self._prefix_keyed = counter(
            "corolla_prefix_keyed_tokens", "Positions sessions named by prefix keys when they opened"
        )
        self._prefix_hits = counter(
            "corolla_prefix_hit_tokens", "Positions sessions reused from the prefix cache when they opened"
        )
        self._prefix_bytes = gauge(
            "corolla_prefix_cache_bytes", "KV bytes of the cached prefix pages (held by sessions or idle)"
        )
        self._prefix_evictions = gauge(
            "corolla_prefix_cache_evictions",
            "Cached prefix pages evicted so far (for new sessions or past the operator's cap)",
        )
        self._prefix_limit = gauge(
            "corolla_prefix_cache_limit_bytes",
            "The operator's cap on cached prefix pages no session holds (--prefix_cache_tokens; -1: none)",
        )
        self._blocks = gauge("corolla_blocks_served", "Transformer blocks this server holds")
        self._serving_path = gauge(
            "corolla_serving_path", "1 for how the engine runs this span (fused kernels or eager blocks)", ["path"]
        )
        self._announce_failures = counter("corolla_announce_failures", "DHT announcements that failed or timed out")
        self._moves = counter("corolla_moves", "Rebalancing moves the swarm policy decided")
        self._load_seconds = counter("corolla_span_load_seconds", "Seconds spent loading spans (joining and moves)")
        self._loads = counter("corolla_span_loads", "Spans loaded (joining and moves)")
        self._fetching = gauge(
            "corolla_span_fetching", "1 while the server fetches a move's new span and serves its own"
        )
        self._fetch_seconds = counter(
            "corolla_span_fetch_seconds", "Seconds spent fetching moves' new spans while serving"
        )
        self._moves_dropped = counter(
            "corolla_moves_dropped", "Moves given up during or after their fetch: the policy no longer asked for them"
        )
        # Pre-create labelled children so every series is exported (as 0) from the start.
        for reason in REJECT_REASONS:
            self._rejected.labels(reason=reason)
        r.register(_WorkCollector(self))

    # --- sessions ---
    @contextlib.contextmanager
    def session(self) -> Iterator[None]:
        """Counts one open session for the duration of the block, on every exit path."""
        self._sessions_opened.inc()
        self._sessions_active.inc()
        try:
            yield
        finally:
            self._sessions_active.dec()

    # --- work ---
    def read_work(self, source: WorkSource) -> None:
        """From now on a scrape reads `source`'s batches and inference tokens; a source it replaces (the span
        before a move) adds what it counted to the totals kept."""
        with self._lock:
            old = self._source
            if old is not None:
                self._retired = self._retired.plus(old.batch_counts())
                self._retired_tokens += old.inference_tokens
            self._source = source

    def tokens(self, kind: str, n: int) -> None:
        """Tokens a task processed (training forwards and backwards; the engine's inference steps are read from
        the source)."""
        if kind not in self._task_tokens:
            raise ValueError(f"token kind must be one of {TOKEN_KINDS}, got {kind!r}")
        if n < 0:
            raise ValueError(f"token count must be >= 0, got {n}")
        with self._lock:
            self._task_tokens[kind] += n

    def queue_wait(self, seconds: float) -> None:
        self._queue_wait.observe(max(0.0, seconds))

    def work(self) -> tuple[BatchCounts, dict[str, int]]:
        """Every batch so far and the tokens per kind (the source's, the replaced sources' and the tasks')."""
        with self._lock:
            source, batches = self._source, self._retired
            tokens = dict(self._task_tokens)
            tokens["inference"] += self._retired_tokens
        if source is not None:
            batches = batches.plus(source.batch_counts())
            tokens["inference"] += source.inference_tokens
        return batches, tokens

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

    def fetch_started(self) -> None:
        self._fetching.set(1)

    def fetch_ended(self, seconds: float) -> None:
        self._fetching.set(0)
        self._fetch_seconds.inc(max(0.0, seconds))

    def move_dropped(self) -> None:
        self._moves_dropped.inc()

    def tokens_total(self) -> int:
        """Tokens processed so far, every kind."""
        return sum(self.work()[1].values())

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


class _WorkCollector:
    """The work series, built from `ServerMetrics.work` at each scrape."""

    def __init__(self, metrics: ServerMetrics):
        self.metrics = metrics

    def collect(self) -> Iterable[Metric]:
        batches, tokens = self.metrics.work()
        counted = CounterMetricFamily(
            "corolla_tokens_processed", "Tokens processed by the served blocks, by kind", labels=["kind"]
        )
        for kind in TOKEN_KINDS:
            counted.add_metric([kind], tokens[kind])
        yield counted
        yield _histogram(
            "corolla_step_seconds", "Time the runtime spent executing one batch", BATCH_SECONDS_BOUNDS,
            batches.seconds, batches.seconds_sum,
        )  # fmt: skip
        yield _histogram(
            "corolla_batch_size", "Steps merged into one executed batch", BATCH_STEPS_BOUNDS, batches.steps,
            batches.steps_sum,
        )  # fmt: skip


def _histogram(
    name: str, documentation: str, bounds: tuple[float, ...], counts: tuple[int, ...], total: float
) -> HistogramMetricFamily:
    """A histogram family from per-bucket counts (the last one past every bound): cumulative, as exported."""
    cumulative = list(accumulate(counts))
    buckets = [(repr(float(bound)), count) for bound, count in zip(bounds, cumulative, strict=False)]
    buckets.append(("+Inf", cumulative[-1]))
    return HistogramMetricFamily(name, documentation, buckets=buckets, sum_value=total)
