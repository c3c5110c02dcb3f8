"""ServerMetrics: the exposition parses with prometheus_client's parser and moves as the server reports work."""

from __future__ import annotations

import urllib.request
from bisect import bisect_left

import pytest
from prometheus_client.parser import text_string_to_metric_families

from corolla.server.core.batch_counts import BATCH_SECONDS_BOUNDS, BATCH_STEPS_BOUNDS, BatchCounts
from corolla.server.metrics import REJECT_REASONS, TOKEN_KINDS, ServerMetrics


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Maps (sample name, sorted labels) to value for every sample of the exposition."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(text: str, name: str, **labels: str) -> float:
    return samples(text)[(name, tuple(sorted(labels.items())))]


def test_all_series_exported_from_start():
    text = ServerMetrics().render().decode()
    names = {f.name for f in text_string_to_metric_families(text)}
    for name in (
        "corolla_sessions_active",
        "corolla_sessions_opened",
        "corolla_tokens_processed",
        "corolla_step_seconds",
        "corolla_queue_wait_seconds",
        "corolla_batch_size",
        "corolla_requests_rejected",
        "corolla_kv_cache_used_bytes",
        "corolla_kv_cache_free_bytes",
        "corolla_blocks_served",
        "corolla_announce_failures",
    ):
        assert name in names
    for kind in TOKEN_KINDS:
        assert value(text, "corolla_tokens_processed_total", kind=kind) == 0
    for reason in REJECT_REASONS:
        assert value(text, "corolla_requests_rejected_total", reason=reason) == 0


class FakeWork:
    """A `WorkSource`: batches as a runtime counts them (`BatchCounts`), tokens as an engine executor counts them."""

    def __init__(self) -> None:
        self.counts = BatchCounts()
        self.inference_tokens = 0

    def batch_counts(self) -> BatchCounts:
        return self.counts

    def ran(self, seconds: float, steps: int) -> None:
        """One more batch, counted as the runtime counts it."""
        at_s, at_steps = bisect_left(BATCH_SECONDS_BOUNDS, seconds), bisect_left(BATCH_STEPS_BOUNDS, steps)
        one = BatchCounts(
            tuple(int(i == at_s) for i in range(len(BATCH_SECONDS_BOUNDS) + 1)), seconds,
            tuple(int(i == at_steps) for i in range(len(BATCH_STEPS_BOUNDS) + 1)), steps,
        )  # fmt: skip
        self.counts = self.counts.plus(one)


def test_metrics_move_across_a_generation():
    m = ServerMetrics()
    work = FakeWork()
    m.blocks_served(3)
    m.set_cache(0, 1000)
    before = m.render().decode()
    assert value(before, "corolla_sessions_active") == 0

    with m.session():
        m.set_cache(600, 400)
        during = m.render().decode()
        assert value(during, "corolla_sessions_active") == 1
        assert value(during, "corolla_kv_cache_used_bytes") == 600
        assert value(during, "corolla_kv_cache_free_bytes") == 400
        m.read_work(work)
        work.inference_tokens = 7  # prefill of a 7-token prompt
        for _ in range(5):  # five merged decode steps of two sessions, each batch counted by the runtime
            m.queue_wait(0.002)
            work.ran(0.03, 2)
            work.inference_tokens += 1
    m.tokens("forward", 16)
    m.set_cache(0, 1000)
    after = m.render().decode()

    assert value(after, "corolla_sessions_active") == 0
    assert value(after, "corolla_sessions_opened_total") == 1
    assert value(after, "corolla_tokens_processed_total", kind="inference") == 12
    assert value(after, "corolla_tokens_processed_total", kind="forward") == 16
    assert value(after, "corolla_tokens_processed_total", kind="backward") == 0
    assert value(after, "corolla_step_seconds_count") == 5
    assert value(after, "corolla_step_seconds_sum") == pytest.approx(0.15)
    assert value(after, "corolla_step_seconds_bucket", le="0.025") == 0
    assert value(after, "corolla_step_seconds_bucket", le="0.05") == 5
    assert value(after, "corolla_queue_wait_seconds_count") == 5
    assert value(after, "corolla_batch_size_bucket", le="1.0") == 0
    assert value(after, "corolla_batch_size_bucket", le="2.0") == 5
    assert value(after, "corolla_batch_size_sum") == 10
    assert value(after, "corolla_blocks_served") == 3
    assert value(after, "corolla_kv_cache_used_bytes") == 0


def test_session_closed_on_error_and_rejections_and_announces():
    m = ServerMetrics()
    with pytest.raises(RuntimeError), m.session():
        raise RuntimeError("stream broke")
    m.rejected("cache_full")
    m.rejected("cache_full")
    m.rejected("something new")
    m.announce_failed()
    text = m.render().decode()
    assert value(text, "corolla_sessions_active") == 0
    assert value(text, "corolla_requests_rejected_total", reason="cache_full") == 2
    assert value(text, "corolla_requests_rejected_total", reason="other") == 1
    assert value(text, "corolla_announce_failures_total") == 1


def test_a_replaced_source_keeps_its_counts():
    """A span's move replaces the executor the metrics read: the counters never go back."""
    m = ServerMetrics()
    old, new = FakeWork(), FakeWork()
    m.read_work(old)
    old.ran(0.004, 3)
    old.inference_tokens = 3
    m.read_work(new)
    new.ran(0.004, 1)
    new.inference_tokens = 1
    text = m.render().decode()
    assert value(text, "corolla_tokens_processed_total", kind="inference") == 4
    assert value(text, "corolla_step_seconds_count") == 2
    assert value(text, "corolla_batch_size_sum") == 4
    assert m.tokens_total() == 4


def test_bad_input_rejected():
    m = ServerMetrics()
    with pytest.raises(ValueError, match="kind"):
        m.tokens("decode", 1)
    with pytest.raises(ValueError, match=">= 0"):
        m.tokens("forward", -1)


def test_two_servers_in_one_process_do_not_share_series():
    a, b = ServerMetrics(), ServerMetrics()
    a.tokens("forward", 5)
    assert value(b.render().decode(), "corolla_tokens_processed_total", kind="forward") == 0


def test_http_exporter_on_loopback():
    m = ServerMetrics()
    m.tokens("backward", 3)
    exporter = m.serve(0)
    try:
        assert exporter.host == "127.0.0.1" and exporter.port > 0
        with urllib.request.urlopen(exporter.url, timeout=5) as response:
            text = response.read().decode()
        assert value(text, "corolla_tokens_processed_total", kind="backward") == 3
    finally:
        exporter.close()
