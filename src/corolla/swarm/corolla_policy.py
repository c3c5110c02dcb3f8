"""`CorollaPolicy`: placement that maximizes the swarm's bottleneck flow with the server's own capacity (span length
and position), moves that pay back their reload with hysteresis, and load-aware randomized routing. Decentralized:
every decision is one peer's, from signed records and its own measurements; wire-compatible with Petals peers."""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from corolla.protocol.records import RemoteSpanInfo
from corolla.swarm.policy import MoveDecision, RouteMode, ServerCapacity, others, own_span
from corolla.swarm.route_planning import (
    MISSING_CACHE_PENALTY_S,
    announced_rtt_s,
    block_time_s,
    covers,
    make_max_throughput_route,
    make_min_latency_route,
)
from corolla.swarm.spans import compute_throughputs

REL_EPS = 1e-9  # flows equal up to float noise are ties
GAP_TPS = 1e-6  # the least tokens/s a block counts as in the soft bottleneck (finite, so placements with gaps compare)


@dataclass(frozen=True)
class CorollaPolicy:
    """Placement, rebalancing and routing for throughput under load.

    Placement: a server of capacity `me` may hold k <= max_blocks blocks; holding fewer raises its tokens/s
    (`ServerCapacity.throughput_for`: its own curve where known, as fewer blocks leave more memory for KV; else
    Petals' model). For every k and start it computes the swarm's bottleneck (the least per-block throughput, about
    the max-flow when chains may enter a span anywhere) and keeps the placements within `shorter_span_gain` of the
    best; among them, the best soft bottleneck (the power mean of order -`balance_power` of per-block throughputs,
    which a flat bottleneck leaves free to rise: lifting weak blocks that are not the very weakest), blocks without
    a server counting as `gap_credit` x its own throughput at max_blocks when it knows its curve (a server to come
    will cover them; so a joiner takes the few blocks it serves fast instead of spreading thin over the gaps), else
    as ~0 (gaps first); then the longest span (fewer hops), then Petals' weakest-window rule. Where the server
    measured RTTs to servers within `region_rtt_s` (its region), every flow above is its region's (the other
    servers ignored): each region completes its own chains, whose hops cost a few ms instead of tens between regions.
    On Helix's 24-node cluster (one region), nodes joining one by one this way reach 1476 tok/s of max-flow, against
    1290 for Helix's central ILP (`sim/helix.py`).

    Rebalancing (flows of its region, as placement): move only if the best placement without itself beats the
    bottleneck now by `min_gain` of the bottleneck or of its own throughput, whichever is less (hysteresis: each
    move raises the bottleneck by a positive floor, so moves cannot cycle), the gain over `payback_s` outweighs the
    flow lost while reloading for `reload_s`, leaving opens no gap (in the swarm, nor in a region that has none),
    and the server has stayed `min_dwell_s` since its last move (unless its region has a block without a server:
    then it may fill the gap now). A server that places by region moves only once it has measured every server
    announced (`swarm.rtt_book` keeps its pings across checks): on a part of its region each check would weigh a
    different swarm; until then it moves only to fill a block the whole swarm lacks.

    Routing: Dijkstra over (server, block) as Petals, each block costing max(its one-session time, the share of the
    server's capacity left to one more session), where sessions = those the server announces plus the ones this
    client just routed there; each server's cost is jittered by a log-normal factor of sigma `route_jitter` per
    route, so clients spread over near-equal chains instead of piling onto one; a switch between two servers costs
    half the RTT the first announced to the second, else half the client's RTTs to both (`estimated_rtt_s`).
    Entering a server costs by the room it announced (`cache_entry_cost_s`): sessions of this size its free cache
    holds, less the ones this client just routed there; none left costs Petals' 10 s, a little room
    `crowding_cost_s` / room, so clients reading the same records do not all race for the last few places.
    Near first (`near_spans`): where the servers within `region_rtt_s` of the client cover every block of the route
    but lack room for the session, the client does not take a chain out of its region for the room (it takes the
    near chain, is refused, and waits for room there) until the session has waited `near_patience_s`: a chain that
    leaves the client's region costs every token an inter-region RTT or two (0.1-0.4 s against a few ms a hop), and
    the cache it holds there is what that region's own clients wait for; a full swarm whose clients spill into each
    other's regions serves the same sessions at a slower pace (decision 0030). A chain that leaves the region for
    speed while the region has room is taken as before."""

    shorter_span_gain: float = 0.10
    min_gain: float = 0.10
    balance_power: float = 1.0
    gap_credit: float = 1.0
    payback_s: float = 3600.0
    min_dwell_s: float = 300.0
    region_rtt_s: float = 0.03
    route_jitter: float = 0.25
    crowding_cost_s: float = 0.05
    near_patience_s: float = 120.0
    name: str = "corolla"
    uses_rtts: bool = True

    @property
    def route_region_rtt_s(self) -> float | None:
        return self.region_rtt_s

    # ---- placement

    def choose_span(self, me: ServerCapacity, spans: Sequence[RemoteSpanInfo], total_blocks: int) -> range:
        rest = self._region(me, others(spans, me.peer_id))
        return self._best_placement(me, rest, total_blocks)[2]

    def _region(self, me: ServerCapacity, spans: Sequence[RemoteSpanInfo]) -> list[RemoteSpanInfo]:
        """The spans whose servers `me` measured within `region_rtt_s` (the caller's own span kept), or all of
        `spans` when it measured none near: chains that stay in a region pay a few ms per hop instead of tens, so a
        server completes its region's chains first and the swarm's flow is the sum of the regions'."""
        near = {peer for peer, rtt in me.rtts_s.items() if rtt <= self.region_rtt_s}
        if not near:
            return list(spans)
        return [s for s in spans if s.peer_id in near or s.peer_id == me.peer_id]

    def _region_unmeasured(self, me: ServerCapacity, spans: Sequence[RemoteSpanInfo]) -> bool:
        """True where `me` places by region (it measured a server within `region_rtt_s`) but has not measured every
        server of `spans`: the servers it has not measured may be of its region, so its region's flows are unknown."""
        if not any(rtt <= self.region_rtt_s for rtt in me.rtts_s.values()):
            return False
        return any(s.peer_id not in me.rtts_s for s in spans if s.peer_id != me.peer_id)

    def _best_placement(
        self,
        me: ServerCapacity,
        rest: Sequence[RemoteSpanInfo],
        total_blocks: int,
        *,
        free_cache: np.ndarray | None = None,
    ) -> tuple[float, float, range]:
        """(bottleneck tokens/s, soft bottleneck, the span) for the best placement of `me` beside `rest` (the order
        of criteria is in the class docstring). free_cache: the free KV per block `[total_blocks]` to weigh (default:
        what `rest` announce)."""
        if total_blocks < 1:
            raise ValueError(f"total_blocks must be >= 1, got {total_blocks}")
        strength = self._strength(me, rest, total_blocks, free_cache)
        throughputs = strength.throughputs
        max_k = min(me.max_blocks, total_blocks)
        options = []  # (k, flows[num_starts], soft[num_starts])
        for k in range(1, max_k + 1):
            soft = strength.soft_by_start(me, k, self.balance_power)
            options.append((k, _bottleneck_by_start(throughputs, me.throughput_for(k), k)[1], soft))
        best_flow = max(float(flows.max()) for _, flows, _ in options)
        floor = best_flow / (1 + self.shorter_span_gain) - REL_EPS * max(best_flow, 1.0)
        best_soft = [float(soft[flows >= floor].max(initial=0.0)) for _, flows, soft in options]  # [max_k]
        top = max(best_soft)
        # the longest span among the best: a shorter one adds a hop to every chain through it
        k = max(k for k, soft in zip(range(1, max_k + 1), best_soft, strict=True) if soft >= top - REL_EPS * top)
        _, flows, soft = options[k - 1]
        starts = np.flatnonzero((flows >= floor) & (soft >= top - REL_EPS * top)).tolist()
        # Petals' rule among the rest: the window whose ascending throughputs are lexicographically smallest
        start = min((sorted(throughputs[s : s + k].tolist()), s) for s in starts)[1]
        return float(flows[start]), float(soft[start]), range(start, start + k)

    def _strength(
        self,
        me: ServerCapacity,
        rest: Sequence[RemoteSpanInfo],
        total_blocks: int,
        free_cache: np.ndarray | None = None,
    ) -> BlockStrength:
        """Per-block strength of `rest` as `me` weighs it: with its free KV where `me` knows its own and every span
        of `rest` announces it (`BlockStrength`)."""
        throughputs = compute_throughputs({s.peer_id: s for s in rest}, total_blocks=total_blocks)  # [total_blocks]
        if free_cache is None:
            free_cache = free_cache_by_block(rest, total_blocks)
        max_k = min(me.max_blocks, total_blocks)
        my_cache = me.cache_tokens_for(max_k)
        if my_cache is None:
            free_cache = None
        # blocks without a server count as what a server to come is expected to add there (`gap_credit`)
        gap_tps = self.gap_credit * me.throughput_for(max_k) if me.capacity_tps else 0.0
        gap_cache = self.gap_credit * my_cache if me.capacity_tps and my_cache is not None else 0.0
        # references: the blocks' mean (k-independent, so that every span length is weighed alike), or the server's
        # own figure in an empty swarm
        tps_ref = float(throughputs.mean()) or me.throughput_for(max_k) or 1.0
        cache_ref = 1.0
        if free_cache is not None:
            cache_ref = float(np.maximum(free_cache, 0.0).mean()) or my_cache or 1.0
        return BlockStrength(throughputs, free_cache, tps_ref, cache_ref, gap_tps, gap_cache)

    # ---- rebalancing

    def choose_move(
        self,
        me: ServerCapacity,
        spans: Sequence[RemoteSpanInfo],
        total_blocks: int,
        *,
        reload_s: float,
        since_move_s: float,
        rng: random.Random,
    ) -> MoveDecision:
        everyone = compute_throughputs({s.peer_id: s for s in spans}, total_blocks=total_blocks)  # [total_blocks]
        if self._region_unmeasured(me, spans):
            # a part of its region weighs a different swarm at each check (the oscillation of decision 0025): until
            # it has measured every server announced, it moves only to fill a block no server holds, as one pool
            if float(everyone.min()) > 0:
                flow = float(everyone.min())
                return MoveDecision(None, flow, flow, "its region not yet measured in full")
            me = dataclasses.replace(me, rtts_s={})
        region = self._region(me, spans)  # flows below are the region's (the whole swarm's if none is near)
        throughputs = compute_throughputs({s.peer_id: s for s in region}, total_blocks=total_blocks)
        flow_now = float(throughputs.min())
        mine = own_span(spans, me.peer_id)
        if mine is None:
            return MoveDecision(None, flow_now, flow_now, "own span not in the swarm's records")
        if since_move_s < self.min_dwell_s and flow_now > 0:  # a region with a gap serves no chain: no dwelling then
            return MoveDecision(None, flow_now, flow_now, "dwelling after the last move")
        if float(everyone.min()) > 0 and float((everyone[mine.start : mine.end] - mine.throughput).min()) <= 0:
            return MoveDecision(None, flow_now, flow_now, "leaving would open a gap")
        without_me = throughputs.copy()
        without_me[mine.start : mine.end] -= mine.throughput
        flow_while_loading = float(without_me.min())
        if flow_now > 0 and flow_while_loading <= 0:
            return MoveDecision(None, flow_now, flow_now, "leaving would open a gap in its region")
        # the free cache its region keeps without it: its sessions find room on other servers of the same blocks,
        # so those blocks lose its whole cache, not only what it has free
        rest = others(region, me.peer_id)
        free_without_me = free_cache_by_block(region, total_blocks)
        my_cache = me.cache_tokens_for(mine.length)
        if free_without_me is not None and my_cache is not None:
            free_without_me[mine.start : mine.end] -= my_cache
        flow_after, soft_after, target = self._best_placement(me, rest, total_blocks, free_cache=free_without_me)
        if target == range(mine.start, mine.end):
            return MoveDecision(None, flow_now, flow_now, "already on the best span")
        if flow_after <= 0:
            return MoveDecision(None, flow_now, flow_after, "gain below the hysteresis threshold")
        # hysteresis: the move must add min_gain of the bottleneck or, in a swarm where one server is a small part
        # of it, of the server's own throughput there; every move then raises the bottleneck by a positive floor
        threshold = self.min_gain * min(flow_now, me.throughput_for(len(target)))
        lost_share = (flow_now - flow_while_loading) / flow_now if flow_now > 0 else 0.0
        if flow_after - flow_now >= threshold:
            lost_tokens = (flow_now - flow_while_loading) * max(reload_s, 0.0)
            gained_tokens = (flow_after - flow_now) * self.payback_s
            if gained_tokens <= lost_tokens:
                return MoveDecision(None, flow_now, flow_after, "reload costs more than the move gains")
            return MoveDecision(target, flow_now, flow_after, "raises the swarm's bottleneck")
        # a move for cache: its region's soft bottleneck of strengths (throughput and free cache per block) rises by
        # min_gain without lowering the throughput bottleneck, and pays back the share of flow lost while reloading
        strength = self._strength(me, rest, total_blocks, free_without_me)
        if strength.free_cache is None or flow_after < flow_now:
            return MoveDecision(None, flow_now, flow_after, "gain below the hysteresis threshold")
        soft_now = float(strength.soft_by_start(me, mine.length, self.balance_power)[mine.start])
        gain = soft_after / soft_now - 1 if soft_now > 0 else math.inf
        if gain < self.min_gain:
            return MoveDecision(None, flow_now, flow_after, "gain below the hysteresis threshold")
        if gain * self.payback_s <= lost_share * max(reload_s, 0.0):
            return MoveDecision(None, flow_now, flow_after, "reload costs more than the move gains")
        return MoveDecision(target, flow_now, flow_after, "raises the region's least free cache")

    # ---- routing

    def choose_route(
        self,
        spans: Sequence[RemoteSpanInfo],
        start: int,
        end: int,
        *,
        mode: RouteMode,
        client_rtts_s: Mapping[str, float],
        cache_tokens_needed: int | None = None,
        client_load: Mapping[str, float] | None = None,
        waited_s: float = 0.0,
        rng: random.Random,
    ) -> list[RemoteSpanInfo]:
        if mode == "max_throughput":
            return make_max_throughput_route(spans, start, end, client_rtts_s=client_rtts_s, rng=rng)
        if mode != "min_latency":
            raise ValueError(f"mode must be 'min_latency' or 'max_throughput', got {mode!r}")
        load = client_load or {}
        jitter = {span.peer_id: math.exp(rng.gauss(0.0, self.route_jitter)) for span in spans}

        def block_cost_s(span: RemoteSpanInfo) -> float:
            return loaded_block_time_s(span, load.get(span.peer_id, 0.0)) * jitter[span.peer_id]

        def hop_rtt_s(span: RemoteSpanInfo, other: RemoteSpanInfo) -> float | None:
            return estimated_rtt_s(span, other, client_rtts_s)

        def entry_cost_s(span: RemoteSpanInfo) -> float:
            return cache_entry_cost_s(span, cache_tokens_needed, load.get(span.peer_id, 0.0), self.crowding_cost_s)

        def route_over(spans: Sequence[RemoteSpanInfo]) -> list[RemoteSpanInfo]:
            return make_min_latency_route(
                spans, start, end, client_rtts_s=client_rtts_s, cache_tokens_needed=cache_tokens_needed,
                block_cost_s=block_cost_s, hop_rtt_s=hop_rtt_s, entry_cost_s=entry_cost_s,
            )  # fmt: skip

        route = route_over(spans)
        if waited_s >= self.near_patience_s or cache_tokens_needed is None:
            return route
        near = near_spans(spans, start, end, client_rtts_s, self.region_rtt_s)
        near_peers = {span.peer_id for span in near}
        if len(near) == len(spans) or all(span.peer_id in near_peers for span in route):
            return route
        # the chain leaves the client's region: if its region has no room for the session, it waits for room there
        # (the near chain is refused, the client retries) rather than take the cache other regions' clients wait for
        near_route = route_over(near)
        return near_route if any(entry_cost_s(span) >= MISSING_CACHE_PENALTY_S for span in near_route) else route


def _bottleneck_by_start(throughputs: np.ndarray, added: float, k: int) -> tuple[float, np.ndarray]:
    """(best, flows[num_starts]): the swarm's least per-block throughput if `added` tokens/s cover [s, s + k)."""
    n = len(throughputs)
    prefix_min = np.concatenate(([np.inf], np.minimum.accumulate(throughputs)))  # [n + 1]: min of throughputs[:i]
    suffix_min = np.concatenate((np.minimum.accumulate(throughputs[::-1])[::-1], [np.inf]))  # [n + 1]: of [i:]
    inside = sliding_window_view(throughputs, k).min(axis=1) + added  # [n - k + 1]
    outside = np.minimum(prefix_min[: n - k + 1], suffix_min[k:])  # [n - k + 1]
    flows = np.minimum(inside, outside)
    return float(flows.max()), flows


@dataclass(frozen=True)
class BlockStrength:
    """How strong each block of a region is for placement, before and after a server joins a window.

    Without cache figures (`free_cache` None): its throughput (tokens/s), as Petals weighs it. With them: the lesser
    of its throughput and its free KV cache, each over its reference (the blocks' mean): a session needs KV on every
    block of its chain, so the block with the least free cache turns sessions away however much throughput and cache
    the others have, and a block weak in either is weak. Free cache is what servers announce (`cache_tokens_left`
    over span length): every session's chain crosses every block once, so the cache sessions reserve is the same at
    every block and the least free block is the least provisioned one."""

    throughputs: np.ndarray  # [total_blocks] tokens/s
    free_cache: np.ndarray | None  # [total_blocks] Petals' cache-token unit, may be < 0 (a deficit), or None
    tps_ref: float
    cache_ref: float
    gap_tps: float = 0.0
    gap_cache: float = 0.0

    def values(self, added_tps: float, added_cache: float | None) -> tuple[np.ndarray, np.ndarray]:
        """(before[total_blocks], after[total_blocks]): each block's strength now and with a server of
        `added_tps` tokens/s and `added_cache` free KV per block on it (the caller takes `after` in its window)."""
        gap = self.throughputs <= 0
        before = np.where(gap, max(self.gap_tps, GAP_TPS), self.throughputs) / self.tps_ref  # [n]
        after = (self.throughputs + added_tps) / self.tps_ref  # [n]
        if self.free_cache is not None and added_cache is not None:
            free = np.where(gap, self.gap_cache, np.maximum(self.free_cache, 0.0))  # [n]
            before = np.minimum(before, free / self.cache_ref)
            after = np.minimum(after, np.maximum(self.free_cache + added_cache, 0.0) / self.cache_ref)
        return np.maximum(before, GAP_TPS), np.maximum(after, GAP_TPS)

    def soft_by_start(self, me: ServerCapacity, k: int, power: float) -> np.ndarray:
        """soft[num_starts]: the soft bottleneck of the strengths if `me` holds k blocks from each start."""
        before, after = self.values(me.throughput_for(k), me.cache_tokens_for(k))
        return _soft_by_start(before, after, k, power)


def free_cache_by_block(spans: Sequence[RemoteSpanInfo], total_blocks: int) -> np.ndarray | None:
    """The free KV per block `[total_blocks]` the spans announce (`cache_tokens_left` over span length, Petals'
    unit), summed in sorted peer-id order; None if a span announces none (old Petals servers)."""
    free = np.zeros(total_blocks)
    for span in sorted(spans, key=lambda s: s.peer_id):
        left = span.server_info.cache_tokens_left
        if left is None:
            return None
        free[span.start : span.end] += left / max(span.length, 1)
    return free


def _soft_by_start(before: np.ndarray, after: np.ndarray, k: int, power: float) -> np.ndarray:
    """soft[num_starts]: the power mean of order -`power` of per-block strengths when blocks [s, s + k) take their
    `after` value and the others their `before` one (both > 0)."""
    scale = max(float(before.max()), float(after.max()))  # normalized so that t ** -power cannot overflow
    inverse = (before / scale) ** -power  # [n]
    delta = (after / scale) ** -power - inverse  # [n]
    window = sliding_window_view(delta, k).sum(axis=1)  # [n - k + 1]
    mean = np.maximum((inverse.sum() + window) / len(before), 1e-300)
    return scale * mean ** (-1.0 / power)


def near_spans(
    spans: Sequence[RemoteSpanInfo], start: int, end: int, client_rtts_s: Mapping[str, float], near_rtt_s: float
) -> Sequence[RemoteSpanInfo]:
    """The spans whose servers the client measured within `near_rtt_s` (its region) where they cover every block of
    `[start, end)`, else all `spans` (a region that lacks a block routes over the whole swarm)."""
    near = [span for span in spans if client_rtts_s.get(span.peer_id, math.inf) <= near_rtt_s]
    return near if len(near) < len(spans) and covers(near, start, end) else spans


def estimated_rtt_s(span: RemoteSpanInfo, other: RemoteSpanInfo, client_rtts_s: Mapping[str, float]) -> float | None:
    """The RTT (s) between two servers: the one `span`'s server announced to `other`'s, else at most the path through
    this client (the triangle inequality: two servers near the client are near each other), else None (unknown).
    A server announces pings to a few servers after its span only, so without the estimate most switches would cost
    the 300 ms assumed for an unknown pair, and chains would favour the few pairs that happen to be pinged over the
    servers of the client's own region."""
    announced = announced_rtt_s(span, other)
    if announced is not None:
        return announced
    to_span, to_other = client_rtts_s.get(span.peer_id), client_rtts_s.get(other.peer_id)
    return None if to_span is None or to_other is None else to_span + to_other


def cache_entry_cost_s(
    span: RemoteSpanInfo, cache_tokens_needed: int | None, client_sessions: float, crowding_cost_s: float
) -> float:
    """Seconds added to a chain for entering `span`'s server, by the room its announced free cache leaves: sessions
    of `cache_tokens_needed` tokens it holds (a session takes K and V of each token in each of the span's blocks,
    Petals' unit) less `client_sessions` (this client's routes there, not yet in its record). Under one session:
    Petals' `MISSING_CACHE_PENALTY_S`; else `crowding_cost_s` / room. 0 where either figure is unknown."""
    left = span.server_info.cache_tokens_left
    if cache_tokens_needed is None or left is None:
        return 0.0
    room = left / max(2 * cache_tokens_needed * span.length, 1) - max(client_sessions, 0.0)
    return MISSING_CACHE_PENALTY_S if room < 1 else crowding_cost_s / room


def span_block_rate(span: RemoteSpanInfo) -> float:
    """Token-blocks/s the span's server does at full load, inverting Petals' throughput model (a token uses
    (n + 1) / 2 of its n blocks on average)."""
    return span.throughput * (span.length + 1) / 2


def loaded_block_time_s(span: RemoteSpanInfo, client_sessions: float = 0.0) -> float:
    """Seconds per token per block for one more session on `span`'s server: its one-session time, or its share of
    the server's capacity once the sessions it announces plus `client_sessions` (this client's, not yet announced)
    and this one saturate it."""
    sessions = (span.server_info.sessions_active or 0) + max(client_sessions, 0.0)
    rate = span_block_rate(span)
    shared = (sessions + 1) / rate if rate > 0 else 0.0
    return max(block_time_s(span), shared)
