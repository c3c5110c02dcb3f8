"""`ObservedSteps`: the decode step time per block this client measured on each server it used lately (decision 0189),
kept `OBSERVED_TTL_S`. A server's record says what it likes; what this client timed is its own word: routes price a
server seen slower than `ANNOUNCED_DISCOUNT` x its announced step at what it delivered over that discount, so a slow
server stops attracting new sessions while one within the usual gap keeps its price."""

from __future__ import annotations

import dataclasses
import math
import threading
from collections.abc import Sequence

from corolla.client.routing.announced_pace import announced_token_s
from corolla.protocol.records import DECODE_MAX_TOKENS, RemoteSpanInfo
from corolla.utils.peer_tables import PEERS_KEPT_MAX, remember

# A client's decode step on a server is this many times the server's announced figure and still honest: the figure
# is device time, the client's step adds its queue, the links and its own CPU (decision 0165)
ANNOUNCED_DISCOUNT = 4.0
OBSERVED_TTL_S = 300.0  # an observation older than this is forgotten (0165's window: the server's own figure's age)
OBSERVED_MAX_PEERS = PEERS_KEPT_MAX  # servers kept at most (the slowest observations go first: `_worth`)
# a server a session of this client is moving to is no candidate for another move until measured again since (its
# figure is from before the moved session's load), or this long after
PENDING_S = 10.0


class ObservedSteps:
    """`note(peer_id, block_s, now_s)`: a span of `peer_id` delivered decode steps of `block_s` seconds a block (its
    recent median over its blocks, the client's RTT included); `block_s(peer_id, now_s)`: the latest, if not older
    than `OBSERVED_TTL_S`; `note_long` / `token_block_s`: the same for long steps (prompts, replays), in seconds a
    token a block (decision 0193: a server may crawl on those only, or answer them only well);
    `priced(spans, now_s)`: the spans as routes should price them. `moving_to(peer_id, now_s)`:
    a session moves there; `pending(peer_id, now_s)`: it did, and the server was not measured since (nor `PENDING_S`
    passed): sessions judging their spans then wait for a figure that counts the moved session's load, instead of all
    moving at once onto one server that looked fast without them. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_peer: dict[str, tuple[float, float]] = {}  # peer -> (seconds a block a step, when noted)
        self._long_by_peer: dict[str, tuple[float, float]] = {}  # peer -> (seconds a token a block, when noted)
        self._pending: dict[str, float] = {}  # peer -> when a session of this client moved there (`moving_to`)

    def moving_to(self, peer_id: str, now_s: float) -> None:
        with self._lock:
            remember(self._pending, peer_id, now_s, max_peers=OBSERVED_MAX_PEERS)

    def pending(self, peer_id: str, now_s: float) -> bool:
        with self._lock:
            since = self._pending.get(peer_id)
            if since is None or now_s - since >= PENDING_S:
                return False
            seen = self._by_peer.get(peer_id)
            return seen is None or seen[1] <= since

    def note(self, peer_id: str, block_s: float, now_s: float) -> None:
        self._note(self._by_peer, peer_id, block_s, now_s)

    def note_long(self, peer_id: str, token_block_s: float, now_s: float) -> None:
        self._note(self._long_by_peer, peer_id, token_block_s, now_s)

    def _note(self, table: dict[str, tuple[float, float]], peer_id: str, seconds: float, now_s: float) -> None:
        if not (math.isfinite(seconds) and seconds > 0):
            return
        with self._lock:
            kept = (seconds, now_s)
            remember(table, peer_id, kept, max_peers=OBSERVED_MAX_PEERS, worth=lambda _peer, seen: _worth(seen, now_s))

    def block_s(self, peer_id: str, now_s: float) -> float | None:
        return self._seen(self._by_peer, peer_id, now_s)

    def token_block_s(self, peer_id: str, now_s: float) -> float | None:
        return self._seen(self._long_by_peer, peer_id, now_s)

    def _seen(self, table: dict[str, tuple[float, float]], peer_id: str, now_s: float) -> float | None:
        with self._lock:
            seen = table.get(peer_id)
        if seen is None or now_s - seen[1] > OBSERVED_TTL_S:
            return None
        return seen[0]

    def priced(self, spans: Sequence[RemoteSpanInfo], now_s: float, step_tokens: int = 0) -> list[RemoteSpanInfo]:
        """`spans` with the `inference_rps` of each server seen slower than `ANNOUNCED_DISCOUNT` x its announced
        step lowered to `ANNOUNCED_DISCOUNT` / its observed block time (a record without a figure gets that one):
        like is compared with like, an unmeasured server being priced at its figure. For a route whose first step is
        long (`step_tokens` over `DECODE_MAX_TOKENS`: a fresh session's prompt, a replay), a server seen delivering
        long steps slower than `ANNOUNCED_DISCOUNT` x its announced long step (`announced_token_s`) is priced that
        many times under its figure as well (the lower of the two prices; decision 0218)."""
        long_route = step_tokens > DECODE_MAX_TOKENS
        with self._lock:
            if not self._by_peer and not (long_route and self._long_by_peer):
                return list(spans)
            seen = dict(self._by_peer)
            seen_long = dict(self._long_by_peer) if long_route else {}
        result = []
        for span in spans:
            info = span.server_info
            announced = info.inference_rps if info.inference_rps is not None and info.inference_rps > 0 else None
            price = announced
            observed = seen.get(span.peer_id)
            if observed is not None and now_s - observed[1] <= OBSERVED_TTL_S:
                delivered_rps = ANNOUNCED_DISCOUNT / observed[0]
                price = delivered_rps if price is None else min(price, delivered_rps)
            observed_long = seen_long.get(span.peer_id)
            honest_token_s = announced_token_s(1, info.forward_rps, info.inference_rps)
            if observed_long is not None and now_s - observed_long[1] <= OBSERVED_TTL_S and honest_token_s is not None:
                under = ANNOUNCED_DISCOUNT * honest_token_s / observed_long[0]  # < 1: slower than its honest worst
                if under < 1.0 and price is not None:
                    price *= under
            if price is not None and price != announced:
                span = dataclasses.replace(span, server_info=dataclasses.replace(info, inference_rps=price))
            result.append(span)
        return result


def _worth(seen: tuple[float, float], now_s: float) -> float:
    """What an observation (seconds, when noted) is worth keeping past `OBSERVED_MAX_PEERS` (`peer_tables.remember`):
    those past `OBSERVED_TTL_S` nothing, then the slowest least: a flood of identities measured later cannot push an
    honest server out of a move race's measured-first round (decisions 0214, 0231)."""
    seconds, noted_s = seen
    return -math.inf if now_s - noted_s > OBSERVED_TTL_S else -seconds
