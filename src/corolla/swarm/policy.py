"""The swarm policy seam: placement, rebalancing and routing as pure functions of plain data (spans, throughputs,
announced load, RTTs; no DHT, network or clock), called by the real server and client and by `benchmarks.sim`.

How to drive a policy (the simulator does exactly what the server and client do):

    spans = [RemoteSpanInfo(peer, start, end, ServerInfo(state=ServerState.ONLINE, throughput=tok_s, ...)), ...]
    me = ServerCapacity(peer_id="me", max_blocks=8, throughput=120.0)
    span = policy.choose_span(me, spans, total_blocks)               # a joining server: which blocks to load
    decision = policy.choose_move(me, spans, total_blocks, reload_s=30.0, since_move_s=600.0, rng=rng)
    route = policy.choose_route(spans, 0, total_blocks, mode="min_latency", client_rtts_s={...}, rng=rng)

Block indices are relative to the model's first block. `spans` are every server's current span as the caller sees
it (Petals counts JOINING and ONLINE servers for placement; clients route through ONLINE ones only), the caller's
own span included when it has one. `RemoteSpanInfo.server_info` carries Petals' fields (`throughput` in tokens/s
for the whole span, `inference_rps` in steps/s of one block, `next_pings`, `cache_tokens_left`) and corolla's
optional load fields (`sessions_active`, `busy_fraction`), any of which may be None (a stock Petals server)."""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

from corolla.protocol.records import RemoteSpanInfo

RouteMode = Literal["min_latency", "max_throughput"]
# servers a server pings before placing or moving when its policy places by RTT (`uses_rtts`), of those it has not
# measured yet (`swarm.rtt_book`): the whole of a swarm of ~60 at its join, of 1,000 after ~16 checks; one small RPC
# each
PLACEMENT_PINGS = 64
# while a move's new span is fetched, the server's balance checks come this many times as often (a check reads the
# records: one DHT read), so that a move no longer wanted stops its download sooner (decision 0281: in the simulator a
# quarter of the period cut the fetching a further 14-28% against the period itself)
FETCH_CHECKS_PER_PERIOD = 4


@dataclass(frozen=True)
class ServerCapacity:
    """What a server knows about itself when it places or moves its span.

    max_blocks: the most blocks its memory holds (Petals' `num_blocks`); a policy may choose fewer.
    throughput: the tokens/s it would announce holding `max_blocks` blocks (Petals' `throughput`).
    capacity_tps: where known, `capacity_tps[k - 1]` is its tokens/s holding k blocks, for k = 1..max_blocks: fewer
        blocks leave more memory for KV (more concurrent rows per step), which Petals' model ignores; empty = unknown
        (Petals' model then).
    network_rps: tokens/s its link carries (caps the throughput of any span length); None = unknown.
    rtts_s: RTTs in seconds it measured to other servers (peer id -> s, inf = unreachable), where known.
    cache_tokens_per_block: where known, `cache_tokens_per_block[k - 1]` is the KV cache it holds per block with k
        blocks and no session, in Petals' announced unit (K-or-V token slots: a record's `cache_tokens_left` over its
        span length); fewer blocks leave more memory for KV on each; empty = unknown (placement then weighs
        throughput only)."""

    peer_id: str
    max_blocks: int
    throughput: float
    network_rps: float | None = None
    rtts_s: Mapping[str, float] = field(default_factory=dict)
    capacity_tps: tuple[float, ...] = ()
    cache_tokens_per_block: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        if self.max_blocks < 1:
            raise ValueError(f"max_blocks must be >= 1, got {self.max_blocks}")
        if not self.throughput >= 0:
            raise ValueError(f"throughput must be >= 0, got {self.throughput}")
        if self.capacity_tps and len(self.capacity_tps) != self.max_blocks:
            raise ValueError(
                f"capacity_tps must give max_blocks={self.max_blocks} values, got {len(self.capacity_tps)}"
            )
        if not all(c >= 0 for c in self.capacity_tps):
            raise ValueError("capacity_tps must be >= 0 (NaN is not)")
        if self.cache_tokens_per_block and len(self.cache_tokens_per_block) != self.max_blocks:
            raise ValueError(
                f"cache_tokens_per_block must give max_blocks={self.max_blocks} values, "
                f"got {len(self.cache_tokens_per_block)}"
            )
        if not all(c >= 0 for c in self.cache_tokens_per_block):
            raise ValueError("cache_tokens_per_block must be >= 0 (NaN is not)")

    def throughput_for(self, num_blocks: int) -> float:
        """Tokens/s when holding `num_blocks` blocks: `capacity_tps` where known, else Petals' throughput model (a
        token enters at a uniformly random block of the span, so it uses (n + 1) / 2 blocks on average); the link
        caps it."""
        if self.capacity_tps:
            compute = self.capacity_tps[min(max(num_blocks, 1), self.max_blocks) - 1]
        else:
            compute = self.throughput * (self.max_blocks + 1) / (num_blocks + 1)
        return compute if self.network_rps is None else min(compute, self.network_rps)

    def cache_tokens_for(self, num_blocks: int) -> float | None:
        """KV cache per block when holding `num_blocks` blocks (Petals' unit), None where unknown."""
        if not self.cache_tokens_per_block:
            return None
        return self.cache_tokens_per_block[min(max(num_blocks, 1), self.max_blocks) - 1]


@dataclass(frozen=True)
class MoveDecision:
    """A rebalancing verdict. target: the span to move to (None = stay). flow_now_tps / flow_after_tps: the swarm's
    bottleneck throughput (tokens/s) as the policy estimates it now and after the move. reason: for logs/metrics."""

    target: range | None
    flow_now_tps: float
    flow_after_tps: float
    reason: str

    @property
    def move(self) -> bool:
        return self.target is not None


class SwarmPolicy(Protocol):
    """Placement, rebalancing and routing: every method is a pure function of its arguments (`rng` included)."""

    @property
    def name(self) -> str:
        """The policy's name (logs; the benchmarks' `--policy`)."""
        ...

    @property
    def uses_rtts(self) -> bool:
        """Whether placement reads `ServerCapacity.rtts_s` (a joining server then pings the swarm first)."""
        ...

    @property
    def route_region_rtt_s(self) -> float | None:
        """The RTT bound (s) of the client's region that its routes keep to while they can (None: no region): a
        client does not avoid a server where that would leave its region without a block
        (`swarm.cache_refusals.may_avoid`)."""
        ...

    def choose_span(self, me: ServerCapacity, spans: Sequence[RemoteSpanInfo], total_blocks: int) -> range:
        """The blocks a joining server should load (its own span in `spans`, if any, is ignored)."""
        ...

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
        """Whether the server `me.peer_id` (whose current span is in `spans`) should move, and where. reload_s: the
        seconds loading a new span takes; since_move_s: seconds since it last joined or moved."""
        ...

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
        """A chain of spans covering blocks `[start, end)` (MissingBlocksError if a block has no server).
        client_rtts_s: this client's RTTs (s) to servers; client_load: sessions this client recently routed to each
        server (not yet visible in their announced load); waited_s: how long the session has been failing to get a
        chain (refused for cache, failed), 0 for a first try."""
        ...


def own_span(spans: Sequence[RemoteSpanInfo], peer_id: str) -> RemoteSpanInfo | None:
    """`peer_id`'s span in `spans` (the first one, as `compute_spans` makes at most one per peer)."""
    return next((span for span in spans if span.peer_id == peer_id), None)


def others(spans: Sequence[RemoteSpanInfo], peer_id: str) -> list[RemoteSpanInfo]:
    return [span for span in spans if span.peer_id != peer_id]
