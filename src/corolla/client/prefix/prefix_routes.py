"""Cache-affine routing: which chain held which prefix when a session ended (chain hash -> route, bounded, least
recently used forgotten first), and whether the next session of that conversation should take that chain again: yes
unless a server of it left, is overloaded, or a faster chain would win back the prefill it saves over the answer."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from corolla.client.prefix.prefix_chain import PrefixChain
from corolla.protocol.prefix import PREFIX_BLOCK_TOKENS
from corolla.protocol.records import RemoteSpanInfo
from corolla.swarm.route_planning import block_time_s
from corolla.utils.logging import get_logger

logger = get_logger(__name__)

MAX_REMEMBERED_BLOCKS = 16384  # chain hashes kept (each names one block of some conversation's prefix)
OVERLOADED_BUSY_FRACTION = 0.9  # a server busier than this is not worth waiting for
PREFILL_SPEEDUP = 8.0  # a prefilled token costs this much less than a decoded one (batched matmuls)


@dataclass(frozen=True)
class RememberedChain:
    """The chain (peer, start, end) per span that held a prefix, and how many of its positions (whole blocks)."""

    spans: tuple[tuple[str, int, int], ...]
    cached_tokens: int


def chain_step_s(route: Sequence[RemoteSpanInfo]) -> float:
    """A decode step over `route` at the speeds its servers announce (the routes' default rate where one does not)."""
    return sum(span.length * block_time_s(span) for span in route)


def fastest_step_s(view: Sequence[RemoteSpanInfo], route: Sequence[RemoteSpanInfo], start: int, end: int) -> float:
    """A lower bound of any chain's decode step over blocks `[start, end)` (which `route` covers): per block, the
    fastest server that announces its speed, or `route`'s own server if none is faster. A server that announces no
    speed (it served no step yet) does not count: at the default figure a newcomer would win the session, cache or
    not."""
    total = 0.0
    for block in range(start, end):
        own = next(block_time_s(s) for s in route if s.start <= block < s.end)
        times = [
            block_time_s(s)
            for s in view
            if s.start <= block < s.end and s.server_info.inference_rps is not None and s.server_info.inference_rps > 0
        ]
        total += min([own, *times])
    return total


class PrefixRoutes:
    """Chain hash of a block -> the chain that held it (thread-safe; sessions end on any thread)."""

    def __init__(self, max_blocks: int = MAX_REMEMBERED_BLOCKS):
        self.max_blocks = max_blocks
        self._chains: OrderedDict[bytes, RememberedChain] = OrderedDict()
        self._lock = threading.Lock()
        self.num_affine = 0  # sessions routed to the chain that held their prefix

    def remember(self, chain: PrefixChain, route: Sequence[RemoteSpanInfo], positions: int) -> None:
        """The session of `chain` ends on `route` with its first `positions` positions in the servers' caches."""
        blocks = min(positions // PREFIX_BLOCK_TOKENS, len(chain.hashes))
        if not route or blocks == 0 or not chain.active:
            return
        remembered = RememberedChain(tuple((s.peer_id, s.start, s.end) for s in route), blocks * PREFIX_BLOCK_TOKENS)
        with self._lock:
            for block in range(blocks):
                self._chains[chain.hashes[block]] = remembered
                self._chains.move_to_end(chain.hashes[block])
            while len(self._chains) > self.max_blocks:
                self._chains.popitem(last=False)

    def lookup(self, chain: PrefixChain) -> tuple[RememberedChain, int] | None:
        """The chain that held the longest prefix of `chain`, and that prefix's length in positions."""
        with self._lock:
            for block in range(len(chain.hashes) - 1, -1, -1):
                remembered = self._chains.get(chain.hashes[block])
                if remembered is not None:
                    self._chains.move_to_end(chain.hashes[block])
                    return remembered, min((block + 1) * PREFIX_BLOCK_TOKENS, remembered.cached_tokens)
        return None

    def route_for(
        self, view: Sequence[RemoteSpanInfo], chain: PrefixChain, start: int, end: int, *, new_tokens: int
    ) -> list[RemoteSpanInfo] | None:
        """The remembered chain for `chain`'s prefix over blocks `[start, end)`, or None (plan as usual): when none is
        remembered, a server of it left the view or is overloaded, or its slower steps over `new_tokens` generated
        tokens would cost more than the prefill it saves."""
        found = self.lookup(chain)
        if found is None:
            return None
        remembered, cached_tokens = found
        route: list[RemoteSpanInfo] = []
        for peer_id, span_start, span_end in remembered.spans:
            current = next(
                (s for s in view if s.peer_id == peer_id and s.start <= span_start and span_end <= s.end), None
            )
            if current is None:
                logger.debug("prefix_routes.gone(peer=...%s)", peer_id[-6:])
                return None
            busy = current.server_info.busy_fraction
            if busy is not None and busy >= OVERLOADED_BUSY_FRACTION:
                logger.debug("prefix_routes.overloaded(peer=...%s, busy=%.2f)", peer_id[-6:], busy)
                return None
            route.append(RemoteSpanInfo(peer_id, span_start, span_end, current.server_info))
        if not route or route[0].start != start or route[-1].end != end:
            return None
        step_s = chain_step_s(route)
        saved_s = cached_tokens * step_s / PREFILL_SPEEDUP
        lost_s = (step_s - fastest_step_s(view, route, start, end)) * new_tokens
        if lost_s > saved_s:
            logger.debug("prefix_routes.slower(saved_s=%.3f, lost_s=%.3f)", saved_s, lost_s)
            return None
        with self._lock:
            self.num_affine += 1
        return route
