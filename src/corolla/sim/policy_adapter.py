"""A thin adapter giving today's real placement, rebalancing and routing functions (`swarm/block_selection.py`,
`client/route_planning.py`) the shape of the swarm policy seam (choose_span / choose_move / choose_route over a
list of spans), so the simulator drives the real code; it goes away when `corolla.swarm.policy` lands."""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from corolla.client.route_planning import make_max_throughput_route, make_min_latency_route
from corolla.protocol.records import RemoteModuleInfo, RemoteSpanInfo
from corolla.swarm.block_selection import choose_best_blocks, should_choose_other_blocks

UID_PREFIX = "sim"
POLICY_NAMES = ("petals",)


@dataclass(frozen=True)
class ServerCapacity:
    """What a server knows about itself: the most blocks its memory holds and the throughput it would announce."""

    peer_id: str
    max_blocks: int
    throughput: float
    network_rps: float | None = None
    rtts_s: Mapping[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class MoveDecision:
    target: range | None
    flow_now_tps: float
    flow_after_tps: float
    reason: str

    @property
    def move(self) -> bool:
        return self.target is not None


def module_infos(spans: Sequence[RemoteSpanInfo], total_blocks: int) -> list[RemoteModuleInfo]:
    """Per-block records as the DHT would return them for these spans (each record carries its start/end)."""
    infos = [RemoteModuleInfo(f"{UID_PREFIX}.{i}") for i in range(total_blocks)]
    for span in spans:
        for block in range(span.start, span.end):
            infos[block].servers[span.peer_id] = span.server_info
    return infos


@dataclass(frozen=True)
class PetalsPolicy:
    """Petals' exact math through today's functions: weakest-window placement, balance-quality moves, min-latency
    routing for inference."""

    balance_quality: float = 0.75
    name: str = "petals"

    def choose_span(self, me: ServerCapacity, spans: Sequence[RemoteSpanInfo], total_blocks: int) -> range:
        rest = [s for s in spans if s.peer_id != me.peer_id]
        blocks = choose_best_blocks(min(me.max_blocks, total_blocks), module_infos(rest, total_blocks))
        return range(blocks[0], blocks[-1] + 1)

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
        infos = module_infos(spans, total_blocks)
        mine = next((s for s in spans if s.peer_id == me.peer_id), None)
        if mine is None or not should_choose_other_blocks(me.peer_id, infos, self.balance_quality, rng=rng):
            return MoveDecision(None, 0.0, 0.0, "balanced enough")
        target = self.choose_span(ServerCapacity(me.peer_id, mine.length, me.throughput), spans, total_blocks)
        return MoveDecision(target, 0.0, 0.0, "swarm below balance_quality")

    def choose_route(
        self,
        spans: Sequence[RemoteSpanInfo],
        start: int,
        end: int,
        *,
        mode: str,
        client_rtts_s: Mapping[str, float],
        cache_tokens_needed: int | None = None,
        client_load: Mapping[str, float] | None = None,
        rng: random.Random,
    ) -> list[RemoteSpanInfo]:
        if mode == "min_latency":
            return make_min_latency_route(
                spans, start, end, client_rtts_s=client_rtts_s, cache_tokens_needed=cache_tokens_needed
            )
        return make_max_throughput_route(spans, start, end, client_rtts_s=client_rtts_s, rng=rng)


def make_policy(name: str, *, balance_quality: float | None = None) -> PetalsPolicy:
    if name not in POLICY_NAMES:
        raise ValueError(f"swarm policy must be one of {POLICY_NAMES}, got {name!r}")
    return PetalsPolicy() if balance_quality is None else PetalsPolicy(balance_quality=balance_quality)
