"""Pure route math over server spans (Petals' client, reference section 11.2): the lowest-latency chain for inference
(our own Dijkstra over (server, block) nodes, its per-block cost replaceable) and a span-length-weighted random
chain for forward/backward."""

from __future__ import annotations

import heapq
import itertools
import math
import random
from collections.abc import Callable, Collection, Mapping, Sequence

from corolla.protocol.records import RemoteSpanInfo
from corolla.utils.errors import MissingBlocksError

DEFAULT_HALF_RTT_S = 0.15  # one-way delay assumed for a server we could not ping
MAX_HALF_RTT_S = 5.0
SERIALIZATION_OVERHEAD_S = 0.018  # per hop: encode + decode of hidden states
MISSING_CACHE_PENALTY_S = 10.0  # avoid servers that cannot fit this session's KV cache
DEFAULT_INFERENCE_RPS = 300.0  # blocks per second assumed when a server does not announce it
UNREACHABLE_WEIGHT = 1e-6  # max-throughput weight of a server whose ping failed


def spans_by_block(spans: Sequence[RemoteSpanInfo], num_blocks: int) -> list[list[RemoteSpanInfo]]:
    """For each block index in `[0, num_blocks)`, the spans that contain it."""
    result: list[list[RemoteSpanInfo]] = [[] for _ in range(num_blocks)]
    for span in spans:
        for block in range(max(span.start, 0), min(span.end, num_blocks)):
            result[block].append(span)
    return result


def find_missing_blocks(spans: Sequence[RemoteSpanInfo], start: int, end: int) -> list[int]:
    covered: set[int] = set()
    for span in spans:
        covered.update(range(max(span.start, start), min(span.end, end)))
    return [block for block in range(start, end) if block not in covered]


def covers(spans: Sequence[RemoteSpanInfo], start: int, end: int) -> bool:
    """Whether `spans` together hold every block of `[start, end)` (a sweep over spans sorted by start)."""
    reach = start
    for span in sorted(spans, key=lambda span: span.start):
        if span.start > reach:
            break
        reach = max(reach, span.end)
        if reach >= end:
            return True
    return reach >= end


def has_cache_for(span: RemoteSpanInfo, cache_tokens_needed: int | None) -> bool:
    """`cache_tokens_left` counts K-or-V (token x block) slots, so a session needs 2 * tokens * blocks of them."""
    left = span.server_info.cache_tokens_left
    if cache_tokens_needed is None or left is None:
        return True
    return cache_tokens_needed * 2 * span.length <= left


def _half_rtt_s(rtt_s: float | None) -> float:
    if rtt_s is None or not math.isfinite(rtt_s):
        return DEFAULT_HALF_RTT_S if rtt_s is None else MAX_HALF_RTT_S
    return min(rtt_s / 2, MAX_HALF_RTT_S)


def block_time_s(span: RemoteSpanInfo) -> float:
    """Seconds one block of `span`'s server takes for one token of one session (Petals: 1 / inference_rps)."""
    rps = span.server_info.inference_rps
    return 1.0 / (rps if rps is not None and rps > 0 else DEFAULT_INFERENCE_RPS)


def announced_rtt_s(span: RemoteSpanInfo, other: RemoteSpanInfo) -> float | None:
    """The RTT (s) `span`'s server announced to `other`'s in its `next_pings` (Petals' only source), or None."""
    return (span.server_info.next_pings or {}).get(other.peer_id)


def _check_range(spans: Sequence[RemoteSpanInfo], start: int, end: int) -> None:
    if not 0 <= start < end:
        raise ValueError(f"route must cover at least one block, got [{start}, {end})")
    missing = find_missing_blocks(spans, start, end)
    if missing:
        raise MissingBlocksError(missing)


def make_min_latency_route(
    spans: Sequence[RemoteSpanInfo],
    start: int,
    end: int,
    *,
    client_rtts_s: Mapping[str, float],
    cache_tokens_needed: int | None = None,
    block_cost_s: Callable[[RemoteSpanInfo], float] = block_time_s,
    hop_rtt_s: Callable[[RemoteSpanInfo, RemoteSpanInfo], float | None] = announced_rtt_s,
    entry_cost_s: Callable[[RemoteSpanInfo], float] | None = None,
) -> list[RemoteSpanInfo]:
    """The chain minimizing expected step latency through blocks `[start, end)`.

    Nodes are (span, block boundary); edges: client -> first server (half its RTT + overhead), one block inside a
    server (`block_cost_s`, by default Petals' 1 / inference_rps), a switch at the end of a server's span (half the
    RTT between the two servers, `hop_rtt_s`: by default the one the first announced in `next_pings`, None where it
    did not, + overhead), last server -> client. Entering a server costs `entry_cost_s(span)` more; by default
    (Petals) 10 s where it announced too little cache for the session.
    """
    _check_range(spans, start, end)
    by_block = spans_by_block(spans, end)
    # a chain enters a server at some block and stays to the end of its span (or of the route): nodes are (span,
    # block where the chain is), and riding a span costs its blocks one by one (the same float sums per block)
    if entry_cost_s is None:
        penalties = [0.0 if has_cache_for(span, cache_tokens_needed) else MISSING_CACHE_PENALTY_S for span in spans]
    else:
        penalties = [entry_cost_s(span) for span in spans]
    block_costs = [block_cost_s(span) for span in spans]
    START, END = -1, -2  # sentinel span indices
    index_of = {id(span): i for i, span in enumerate(spans)}
    dist: dict[tuple[int, int], float] = {(START, start): 0.0}
    prev: dict[tuple[int, int], tuple[int, int]] = {}
    counter = itertools.count()
    heap: list[tuple[float, int, tuple[int, int]]] = [(0.0, next(counter), (START, start))]
    done: set[tuple[int, int]] = set()

    def relax(node: tuple[int, int], neighbor: tuple[int, int], new_cost: float) -> None:
        if new_cost < dist.get(neighbor, math.inf):
            dist[neighbor] = new_cost
            prev[neighbor] = node
            heapq.heappush(heap, (new_cost, next(counter), neighbor))

    while heap:
        cost, _, node = heapq.heappop(heap)
        if node in done:
            continue
        done.add(node)
        if node[0] == END:
            break
        span_idx, block = node
        if span_idx == START:
            for span in by_block[block]:
                i = index_of[id(span)]
                relax(node, (i, block), cost + (_half_rtt_s(client_rtts_s.get(span.peer_id)) +
                                                SERIALIZATION_OVERHEAD_S + penalties[i]))  # fmt: skip
            continue
        span = spans[span_idx]
        if block == end:
            relax(node, (END, end), cost + _half_rtt_s(client_rtts_s.get(span.peer_id)))
        elif block < span.end:  # entered here: ride to the span's end or the route's
            ride, step = cost, block_costs[span_idx]
            for _ in range(min(span.end, end) - block):
                ride += step
            relax(node, (span_idx, min(span.end, end)), ride)
        else:  # at the span's end: switch to a server holding the next block
            for other in by_block[block]:
                if other is not span:
                    i = index_of[id(other)]
                    relax(node, (i, block), cost + (_half_rtt_s(hop_rtt_s(span, other)) +
                                                    SERIALIZATION_OVERHEAD_S + penalties[i]))  # fmt: skip

    assert (END, end) in prev, "every covered range is reachable: each span's end block is covered by another span"
    path = []
    node = prev[(END, end)]
    while node[0] != START:
        path.append(node)
        node = prev[node]
    path.reverse()  # [(span_idx, block), ...] from the first block boundary to the last
    route: list[RemoteSpanInfo] = []
    for (span_idx, block), (next_idx, next_block) in itertools.pairwise(path):
        if span_idx != next_idx or next_block == block:
            continue
        span = spans[span_idx]
        if route and route[-1].peer_id == span.peer_id and route[-1].end == block:
            route[-1] = RemoteSpanInfo(span.peer_id, route[-1].start, next_block, span.server_info)
        else:
            route.append(RemoteSpanInfo(span.peer_id, block, next_block, span.server_info))
    return route


def make_max_throughput_route(
    spans: Sequence[RemoteSpanInfo],
    start: int,
    end: int,
    *,
    client_rtts_s: Mapping[str, float],
    rng: random.Random | None = None,
) -> list[RemoteSpanInfo]:
    """Spreads forward/backward load: at each uncovered block, pick a covering span with probability proportional
    to its length (servers we cannot reach get a tiny weight), use it to its end, repeat."""
    _check_range(spans, start, end)
    rng = rng or random.Random()
    by_block = spans_by_block(spans, end)
    route, block = [], start
    while block < end:
        candidates = by_block[block]
        weights = [
            UNREACHABLE_WEIGHT if math.isinf(client_rtts_s.get(span.peer_id, 0.0)) else float(span.length)
            for span in candidates
        ]
        span = rng.choices(candidates, weights=weights, k=1)[0]
        route.append(RemoteSpanInfo(span.peer_id, block, min(span.end, end), span.server_info))
        block = min(span.end, end)
    return route


def proven_where_they_cover(spans: Sequence[RemoteSpanInfo], proven: Collection[str]) -> list[RemoteSpanInfo]:
    """`spans` less those whose server is not in `proven` where the spans of `proven` servers cover its blocks
    (a client that caught a loris plans over the servers it saw answer on time where it can, decision 0163)."""
    kept = [span for span in spans if span.peer_id in proven]
    return [span for span in spans if span.peer_id in proven or not covers(kept, span.start, span.end)]
