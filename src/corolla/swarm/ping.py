"""Round-trip times to other peers through the DHT's `rpc_ping` (every Petals peer serves it), and an EMA of them
per peer (`PingAggregator`, alpha 0.2, forgotten after 300 s, at most `peer_tables.PEERS_KEPT_MAX` peers) that servers
announce as `next_pings`."""

from __future__ import annotations

import asyncio
import math
import threading
import time
from collections.abc import Callable, Iterable
from functools import partial
from typing import Any

import hivemind
from hivemind.p2p import P2P, P2PContext, PeerID, ServicerBase
from hivemind.proto import dht_pb2

from corolla.swarm.dht import run_in_dht
from corolla.utils.logging import get_logger
from corolla.utils.peer_tables import remember

logger = get_logger(__name__)

DEFAULT_PING_TIMEOUT_S = 5.0


class _DHTPingService(ServicerBase):
    """Client side of hivemind's `DHTProtocol.rpc_ping` (declared here so we can call it from any P2P)."""

    @classmethod
    def _get_handle_name(cls, namespace: str | None, method_name: str) -> str:
        name = f"DHTProtocol.{method_name}"
        return name if namespace is None else f"{namespace}::{name}"

    async def rpc_ping(self, request: dht_pb2.PingRequest, context: P2PContext) -> dht_pb2.PingResponse:
        raise NotImplementedError


def _as_peer_id(peer_id: PeerID | str) -> PeerID:
    return peer_id if isinstance(peer_id, PeerID) else PeerID.from_base58(peer_id)


async def ping(
    peer_id: PeerID | str,
    p2p: P2P,
    timeout_s: float = DEFAULT_PING_TIMEOUT_S,
    node_info: Any = None,
    authorizer: Any = None,
) -> float:
    """RTT in seconds to `peer_id`, or `inf` on failure. A "protocol not supported" answer (a client-mode DHT
    peer) still proves the peer is alive and counts, as in the reference. In a private swarm pass the DHT's
    `authorizer` (members refuse unsigned pings)."""
    request = dht_pb2.PingRequest(peer=node_info) if node_info is not None else dht_pb2.PingRequest()
    start = time.perf_counter()
    try:
        if authorizer is not None:
            await authorizer.sign_request(request, None)
        stub = _DHTPingService.get_stub(p2p, _as_peer_id(peer_id))
        await stub.rpc_ping(request, timeout=timeout_s)
        return time.perf_counter() - start
    except Exception as e:
        if "not supported" in str(e):  # "protocols not supported: [...]": the peer answered, it just has no DHT
            return time.perf_counter() - start
        logger.debug(f"ping.failed(peer={peer_id}): {e!r:.200}")
        return math.inf


async def ping_from_dht(_dht: hivemind.DHT, node: Any, *, peer_ids: list[str], timeout_s: float) -> dict[str, float]:
    """`{peer_id: rtt_s}`, pinged concurrently inside the DHT process (`run_in_dht`), signed with the DHT's
    authorizer in a private swarm."""
    authorizer = node.protocol.authorizer
    rtts = await asyncio.gather(*(ping(p, node.p2p, timeout_s, node.protocol.node_info, authorizer) for p in peer_ids))
    return dict(zip(peer_ids, rtts, strict=True))


class PingAggregator:
    """Smoothed RTTs per peer: `new = alpha * rtt + (1 - alpha) * old` (a fresh value replaces `inf`); entries not
    refreshed for `expiration_s` are forgotten, and past `peer_tables.PEERS_KEPT_MAX` peers those of least
    `worth(peer_id, rtt_s)` (default: the unreachable first), the least recently updated first among equals: made-up
    records name any number of peers. Thread-safe; `ping()` runs the pings inside the DHT process."""

    def __init__(
        self,
        dht: hivemind.DHT | None = None,
        *,
        ema_alpha: float = 0.2,
        expiration_s: float = 300.0,
        worth: Callable[[str, float], float] | None = None,
    ):
        if not 0 < ema_alpha <= 1:
            raise ValueError(f"ema_alpha must be in (0, 1], got {ema_alpha}")
        self.dht = dht
        self.ema_alpha = ema_alpha
        self.expiration_s = expiration_s
        self._worth = worth or _reachable
        self._rtts: dict[str, tuple[float, float]] = {}  # peer -> (smoothed rtt s, monotonic time of last update)
        self._lock = threading.Lock()

    def update(self, peer_id: str, rtt_s: float, *, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        with self._lock:
            previous = self._get_fresh(peer_id, now)
            if previous is None or math.isinf(previous):
                smoothed = rtt_s
            else:  # an `inf` rtt (failed ping) makes the peer `inf` until it answers again
                smoothed = self.ema_alpha * rtt_s + (1 - self.ema_alpha) * previous
            remember(self._rtts, peer_id, (smoothed, now), worth=self._entry_worth)

    def _entry_worth(self, peer_id: str, entry: tuple[float, float]) -> float:
        return self._worth(peer_id, entry[0])

    def measured(self, peer_id: str, *, now: float | None = None) -> bool:
        """Whether `peer_id` has an RTT (`to_dict` has it), without copying the table."""
        now = time.monotonic() if now is None else now
        with self._lock:
            return self._get_fresh(peer_id, now) is not None

    def _get_fresh(self, peer_id: str, now: float) -> float | None:
        entry = self._rtts.get(peer_id)
        if entry is None or now - entry[1] > self.expiration_s:
            self._rtts.pop(peer_id, None)
            return None
        return entry[0]

    def ping(self, peer_ids: Iterable[str], *, timeout_s: float = DEFAULT_PING_TIMEOUT_S) -> None:
        """Pings peers through the DHT process (bounded) and folds the results in."""
        if self.dht is None:
            raise RuntimeError("PingAggregator.ping needs a DHT; use update() to feed RTTs measured elsewhere")
        peer_ids = [_as_peer_id(p).to_base58() for p in peer_ids]
        if not peer_ids:
            return
        coro = partial(ping_from_dht, peer_ids=peer_ids, timeout_s=timeout_s)
        rtts = run_in_dht(self.dht, coro, timeout_s=timeout_s + 5.0, what=f"ping(n={len(peer_ids)})")
        for peer_id, rtt in rtts.items():
            self.update(peer_id, rtt)

    def to_dict(self, *, now: float | None = None) -> dict[str, float]:
        """`{peer_id_base58: smoothed rtt seconds}` of peers seen within `expiration_s` (may contain `inf`)."""
        now = time.monotonic() if now is None else now
        with self._lock:
            for peer_id in list(self._rtts):
                self._get_fresh(peer_id, now)
            return {peer_id: rtt for peer_id, (rtt, _) in self._rtts.items()}


def _reachable(_peer_id: str, rtt_s: float) -> float:
    """An RTT's default worth: a peer that answered over one that did not."""
    return 0.0 if math.isinf(rtt_s) else 1.0
