"""The server's seat in the swarm: it asks its policy for a span and for moves over the spans the DHT shows, counts
moves and span loads in its metrics, and samples the load its announcer publishes."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from benchmarks.sim.policies import make_policy
from corolla.protocol.records import RemoteSpanInfo, ServerInfo, ServerState
from corolla.server.core.runtime import KindStats
from corolla.server.metrics import ServerMetrics
from corolla.server.slowdown import BLOCK_DELAY_ENV, BlockDelay, block_delay_s, slowed_throughput
from corolla.server.swarm_seat import SwarmSeat


def span(peer: str, start: int, end: int, throughput: float) -> RemoteSpanInfo:
    info = ServerInfo(state=ServerState.ONLINE, throughput=throughput, start_block=start, end_block=end)
    return RemoteSpanInfo(peer, start, end, info)


def make_seat(
    policy: str,
    spans: list[RemoteSpanInfo],
    *,
    max_blocks: int = 2,
    throughput: float = 10.0,
    cache_tokens_per_block: int | None = None,
) -> SwarmSeat:
    seat = SwarmSeat(
        dht=None, module_uids=[f"m.{i}" for i in range(4)], max_blocks=max_blocks,
        throughput_info={"throughput": throughput}, metrics=ServerMetrics(),
        cache_tokens_per_block=cache_tokens_per_block, policy=make_policy(policy),
    )  # fmt: skip
    seat.peer_id = "me"

    async def read_spans() -> list[RemoteSpanInfo]:
        return list(spans)

    seat.read_spans = read_spans  # type: ignore[method-assign]
    return seat


@pytest.mark.parametrize("policy", ["petals", "corolla"])
def test_choose_span_and_move_through_the_policy(policy):
    seat = make_seat(policy, [span("A", 0, 2, 10.0)])
    assert asyncio.run(seat.choose_span()) == range(2, 4)
    assert seat.throughput_for(range(2, 4)) == 10.0
    # "me" doubles blocks 0..1 while 2..3 are thin: both policies move it there
    seat = make_seat(policy, [span("A", 0, 2, 10.0), span("me", 0, 2, 10.0), span("B", 2, 4, 1.0)])
    seat.loaded(5.0)
    seat.online_since -= 1e6  # long past corolla's dwell time
    target = asyncio.run(seat.plan_move())
    assert target == range(2, 4) and seat.num_moves == 0  # planned: it fetches the span while it serves
    seat.moving_to(target)
    assert seat.num_moves == 1
    assert asyncio.run(seat.choose_span()) == range(2, 4) and seat.next_span is None  # the fetched span, loaded next
    text = seat.metrics.render().decode()
    assert "corolla_moves_total 1.0" in text and "corolla_span_load_seconds_total 5.0" in text


def test_a_fetch_in_progress_is_announced_and_in_the_metrics():
    """While a planned move fetches its span the server serves its own: its record says where it moves
    (`moving_to`) and its metrics that it fetches; a move dropped after the fetch is counted."""
    seat = make_seat("corolla", [span("A", 0, 2, 10.0)])
    assert seat.load_fields(None)["moving_to"] is None
    seat.fetch_started(range(2, 4))
    assert seat.load_fields(None)["moving_to"] == (2, 4)
    assert "corolla_span_fetching 1.0" in seat.metrics.render().decode()
    seat.fetch_ended(dropped=True)
    assert seat.load_fields(None)["moving_to"] is None  # given as None, so the announcer clears it
    text = seat.metrics.render().decode()
    assert "corolla_span_fetching 0.0" in text and "corolla_moves_dropped_total 1.0" in text
    assert "corolla_moves_total 0.0" in text
    seat.fetch_started(range(2, 4))
    seat.fetch_ended(dropped=False)
    seat.moving_to(range(2, 4))
    text = seat.metrics.render().decode()
    assert "corolla_moves_dropped_total 1.0" in text and "corolla_moves_total 1.0" in text


def test_corolla_seat_places_its_cache_where_the_swarm_has_least_free():
    # equal throughput on 0..1 and 2..3, but 2..3 announce room for few tokens: the seat's own cache goes there
    def cached(peer: str, start: int, end: int, left: int) -> RemoteSpanInfo:
        info = ServerInfo(state=ServerState.ONLINE, throughput=10.0, start_block=start, end_block=end,
                          cache_tokens_left=left)  # fmt: skip
        return RemoteSpanInfo(peer, start, end, info)

    spans = [cached("A", 0, 2, 4000), cached("B", 2, 4, 40)]
    assert asyncio.run(make_seat("corolla", spans, cache_tokens_per_block=1000).choose_span()) == range(2, 4)
    assert asyncio.run(make_seat("corolla", spans).choose_span()) == range(0, 2)  # its own cache unknown
    assert asyncio.run(make_seat("petals", spans, cache_tokens_per_block=1000).choose_span()) == range(0, 2)


def test_corolla_seat_dwells_after_loading():
    seat = make_seat("corolla", [span("A", 0, 2, 10.0), span("me", 0, 2, 10.0), span("B", 2, 4, 1.0)])
    seat.loaded(5.0)
    assert asyncio.run(seat.plan_move()) is None and seat.num_moves == 0


def test_load_fields_sample_the_runtime():
    seat = make_seat("corolla", [])
    assert seat.load_fields(None) == {"tokens_served": 0, "num_moves": 0, "moving_to": None}
    stats = {"inference": KindStats(busy_s=1.0)}
    service = SimpleNamespace(runtime=SimpleNamespace(stats=lambda: stats), core=SimpleNamespace(num_open=3))
    seat.metrics.tokens("inference", 7)
    first = seat.load_fields(service)
    assert first == {
        "tokens_served": 7,
        "num_moves": 0,
        "moving_to": None,
        "sessions_active": 3,
    }  # no busy share before two samples
    stats["inference"] = KindStats(busy_s=1.0 + 1e9)  # more busy time than wall time passed: clipped to 1
    assert seat.load_fields(service)["busy_fraction"] == 1.0
    assert ServerInfo(state=ServerState.ONLINE, throughput=1.0, **seat.load_fields(service)).busy_fraction == 0.0


def test_slowdown_knob(monkeypatch):
    monkeypatch.delenv(BLOCK_DELAY_ENV, raising=False)
    assert block_delay_s() is None
    monkeypatch.setenv(BLOCK_DELAY_ENV, "0.01")
    assert block_delay_s() == 0.01
    assert slowed_throughput(0.01, 3) == {"throughput": 50.0, "inference_rps": 100.0, "forward_rps": 100.0}
    monkeypatch.setenv(BLOCK_DELAY_ENV, "5")
    with pytest.raises(ValueError, match="COROLLA_TEST_BLOCK_DELAY_S"):
        block_delay_s()
    slept = []
    monkeypatch.setattr("corolla.server.slowdown.time.sleep", slept.append)
    BlockDelay(0.01, 3)("inference", 2, 0.01)  # 2 steps x 3 blocks x 10 ms = 60 ms, 10 of them already spent
    assert slept == [pytest.approx(0.05)]


def test_a_joining_corolla_server_pings_the_swarm_and_places_by_region(monkeypatch):
    """corolla's placement reads RTTs, so the seat pings the servers (through the DHT) before choosing: with the
    near servers lacking blocks 2..3, it takes them; Petals' policy does not ping."""
    pinged: list[list[str]] = []

    class FakePings:
        def __init__(self, dht):
            assert dht == "dht"

        def ping(self, peers, *, timeout_s):
            pinged.append(sorted(peers))

        def to_dict(self):
            return {"near": 0.004, "far1": 0.2, "far2": 0.2}

    monkeypatch.setattr("corolla.server.swarm_seat.PingAggregator", FakePings)
    spans = [span("near", 0, 2, 5.0), span("far1", 0, 2, 5.0), span("far2", 2, 4, 10.0)]
    seat = make_seat("corolla", spans, throughput=5.0)
    seat.dht = "dht"
    assert asyncio.run(seat.choose_span()) == range(2, 4)
    assert pinged == [["far1", "far2", "near"]]
    petals = make_seat("petals", spans, throughput=5.0)
    petals.dht = "dht"
    assert asyncio.run(petals.choose_span()) == range(0, 2)  # both windows carry 10 tok/s: the lower start
    assert len(pinged) == 1


def test_the_corolla_seat_keeps_its_pings_across_checks(monkeypatch):
    """The seat's RTT book: a later check pings only servers it has not measured (the one that joined since), and
    the policy gets every RTT measured so far (decision 0025; the old seat pinged a fresh random sample each time)."""
    pinged: list[list[str]] = []

    class FakePings:
        def __init__(self, dht):
            self.peers: list[str] = []

        def ping(self, peers, *, timeout_s):
            self.peers = sorted(peers)
            pinged.append(self.peers)

        def to_dict(self):
            return {p: 0.004 for p in self.peers}

    monkeypatch.setattr("corolla.server.swarm_seat.PingAggregator", FakePings)
    spans = [span("A", 0, 2, 5.0), span("B", 2, 4, 5.0)]
    seat = make_seat("corolla", spans)
    seat.dht = "dht"
    assert asyncio.run(seat.ping_servers(spans)) == {"A": 0.004, "B": 0.004}
    spans.append(span("C", 0, 2, 5.0))
    assert asyncio.run(seat.ping_servers(spans)) == {"A": 0.004, "B": 0.004, "C": 0.004}
    assert pinged == [["A", "B"], ["C"]]
