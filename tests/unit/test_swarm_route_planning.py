"""The min-latency route against brute force: on small random swarms, the chain it returns costs exactly the least
over every chain a client could take (enter at the route's start or a previous server's end, leave at the span's
end), with Petals' edge costs."""

from __future__ import annotations

import math
import random

import pytest

from corolla.protocol.records import RemoteSpanInfo, ServerInfo, ServerState
from corolla.swarm.route_planning import (
    MISSING_CACHE_PENALTY_S,
    SERIALIZATION_OVERHEAD_S,
    block_time_s,
    covers,
    find_missing_blocks,
    has_cache_for,
    make_min_latency_route,
)


def half(rtt):
    if rtt is None:
        return 0.15
    return 5.0 if not math.isfinite(rtt) else min(rtt / 2, 5.0)


def entry(span, rtt, need):
    return half(rtt) + SERIALIZATION_OVERHEAD_S + (0.0 if has_cache_for(span, need) else MISSING_CACHE_PENALTY_S)


def cheapest(spans, start, end, rtts, need):
    """Least cost over all chains, by exhaustive search."""
    best = math.inf

    def extend(prev, block, cost):
        nonlocal best
        for span in spans:
            if not span.start <= block < span.end:
                continue
            rtt = rtts.get(span.peer_id) if prev is None else (prev.server_info.next_pings or {}).get(span.peer_id)
            if prev is span:
                continue
            c = cost + entry(span, rtt, need)
            stop = min(span.end, end)
            for _ in range(stop - block):
                c += block_time_s(span)
            if stop == end:
                best = min(best, c + half(rtts.get(span.peer_id)))
            else:
                extend(span, stop, c)

    extend(None, start, 0.0)
    return best


def route_cost(route, rtts, need):
    cost, prev = 0.0, None
    for span in route:
        rtt = rtts.get(span.peer_id) if prev is None else (prev.server_info.next_pings or {}).get(span.peer_id)
        cost += entry(span, rtt, need)
        for _ in range(span.length):
            cost += block_time_s(span)
        prev = span
    return cost + half(rtts.get(route[-1].peer_id))


@pytest.mark.parametrize("seed", range(30))
def test_min_latency_route_is_the_cheapest_chain(seed):
    rng = random.Random(seed)
    total = rng.choice([4, 8, 12])
    spans = []
    for i in range(rng.randint(1, 7)):
        length = rng.randint(1, total)
        start = rng.randint(0, total - length)
        spans.append((f"p{i}", start, start + length))
    spans.append(("whole", 0, total))
    peers = [peer for peer, _, _ in spans]
    infos = [
        RemoteSpanInfo(
            peer,
            a,
            b,
            ServerInfo(
                state=ServerState.ONLINE,
                throughput=1.0,
                inference_rps=rng.choice([50.0, 300.0, None]),
                next_pings={q: rng.choice([0.01, 0.08, math.inf]) for q in rng.sample(peers, min(3, len(peers)))},
                cache_tokens_left=rng.choice([None, 100, 10**6]),
            ),
        )  # fmt: skip
        for peer, a, b in spans
    ]
    rtts = {peer: rng.choice([0.005, 0.1, math.inf]) for peer in peers if rng.random() < 0.8}
    start = rng.randrange(total)
    end = rng.randint(start + 1, total)
    route = make_min_latency_route(infos, start, end, client_rtts_s=rtts, cache_tokens_needed=64)
    assert route[0].start == start and route[-1].end == end
    assert all(a.end == b.start for a, b in zip(route, route[1:], strict=False))
    assert route_cost(route, rtts, 64) == pytest.approx(cheapest(infos, start, end, rtts, 64), rel=1e-12)


@pytest.mark.parametrize("seed", range(20))
def test_covers_agrees_with_the_missing_blocks(seed):
    rng = random.Random(seed)
    spans = []
    for i in range(rng.randint(0, 5)):
        start = rng.randrange(10)
        spans.append(RemoteSpanInfo(f"S{i}", start, min(10, start + rng.randint(1, 4)),
                                    ServerInfo(state=ServerState.ONLINE, throughput=1.0)))  # fmt: skip
    start = rng.randrange(10)
    end = rng.randint(start + 1, 10)
    assert covers(spans, start, end) == (not find_missing_blocks(spans, start, end))
