"""`PetalsPolicy`: Petals 2.x's own placement, rebalancing and routing (reference sections 4 and 11.2), exact, behind
the policy seam: the baseline every other policy is measured against, and what wire-compatible swarms that want
Petals' behaviour run."""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from corolla.protocol.records import RemoteSpanInfo
from corolla.swarm.block_selection import choose_best_span, compute_throughputs, should_move_span
from corolla.swarm.policy import MoveDecision, RouteMode, ServerCapacity, others, own_span
from corolla.swarm.route_planning import make_max_throughput_route, make_min_latency_route

DEFAULT_BALANCE_QUALITY = 0.75  # Petals' --balance_quality


@dataclass(frozen=True)
class PetalsPolicy:
    """Cover the weakest window with all `max_blocks`; move when a simulated re-convergence of the swarm would raise
    its bottleneck by more than `balance_quality` allows (ignoring the reload); route inference by min latency and
    forward/backward by span-length-weighted random choice. Load fields and `client_load` are ignored."""

    balance_quality: float = DEFAULT_BALANCE_QUALITY
    name: str = "petals"
    uses_rtts: bool = False
    route_region_rtt_s: float | None = None  # routes over the whole swarm

    def choose_span(self, me: ServerCapacity, spans: Sequence[RemoteSpanInfo], total_blocks: int) -> range:
        num_blocks = min(me.max_blocks, total_blocks)
        return choose_best_span(num_blocks, _by_peer(others(spans, me.peer_id)), total_blocks=total_blocks)

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
        by_peer = _by_peer(spans)
        flow_now = _bottleneck(by_peer, total_blocks)
        mine = own_span(spans, me.peer_id)
        if mine is None:  # the reference asserts here (a known crash); not seeing ourselves is no reason to move
            return MoveDecision(None, flow_now, flow_now, "own span not in the swarm's records")
        if self.balance_quality <= 0 or not should_move_span(
            me.peer_id, by_peer, total_blocks=total_blocks, balance_quality=self.balance_quality, rng=rng
        ):
            return MoveDecision(None, flow_now, flow_now, "balanced enough")
        # Petals leaves (announces OFFLINE), then joins again by choose_best_blocks without itself
        rest = _by_peer(others(spans, me.peer_id))
        target = choose_best_span(mine.length, rest, total_blocks=total_blocks)
        after = dict(rest)
        after[me.peer_id] = RemoteSpanInfo(me.peer_id, target.start, target.stop, mine.server_info)
        return MoveDecision(target, flow_now, _bottleneck(after, total_blocks), "swarm below balance_quality")

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
        if mode == "min_latency":
            return make_min_latency_route(
                spans, start, end, client_rtts_s=client_rtts_s, cache_tokens_needed=cache_tokens_needed
            )
        if mode == "max_throughput":
            return make_max_throughput_route(spans, start, end, client_rtts_s=client_rtts_s, rng=rng)
        raise ValueError(f"mode must be 'min_latency' or 'max_throughput', got {mode!r}")


def _by_peer(spans: Sequence[RemoteSpanInfo]) -> dict[str, RemoteSpanInfo]:
    return {span.peer_id: span for span in spans}


def _bottleneck(spans: Mapping[str, RemoteSpanInfo], total_blocks: int) -> float:
    return float(compute_throughputs(spans, total_blocks=total_blocks).min()) if total_blocks else 0.0
