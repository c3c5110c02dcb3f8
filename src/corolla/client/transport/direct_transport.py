"""Inference streams (and training calls' streams) to a corolla server over its direct TCP port (`protocol.direct_stream`)
instead of through the two p2pd daemons. `DirectInferenceStream` is one such stream on a raw non-blocking socket
(`framed_socket.FramedSocketStream`), sealed after a handshake that proves each side holds the ticket key p2p gave;
`DirectOffers` keeps each server's offer (a ticket reused until shortly before it expires) and, for a while, the
servers with no direct port or not reachable at it. Any problem means "use p2p".

A host no other machine could have (loopback, link-local, multicast, ...) is dialled only where p2p reached that
server at that very address (`dialable`): else a hostile server could have clients send its token to a service on
their own machine (decision 0132)."""

from __future__ import annotations

import asyncio
import dataclasses
import ipaddress
import os
import socket
import time
from collections.abc import Awaitable, Callable, Collection, Iterable

from hivemind.proto import runtime_pb2
from hivemind.utils.multiaddr import Multiaddr, protocols

from corolla.client.transport.framed_socket import FramedSocketStream
from corolla.client.transport.local_transport import frame_response, say_hello
from corolla.protocol import direct_stream as ds
from corolla.protocol import local_stream as ls
from corolla.utils.logging import get_logger
from corolla.utils.peer_tables import remember

logger = get_logger(__name__)

RENEW_BEFORE_EXPIRY_S = 60.0  # a ticket this close to its expiry is renewed before a new stream uses it
NO_DIRECT_RETRY_S = 300.0  # after a server had no direct port (or we could not reach it), ask again this much later


def _only_here(host: str) -> bool:
    """True for an address that names this machine or its link, never another host of the swarm's networks."""
    address = ipaddress.ip_address(host)
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped  # ::ffff:127.0.0.1 is the loopback too
    return (
        address.is_loopback
        or address.is_unspecified
        or address.is_link_local
        or address.is_multicast
        or address.is_reserved
    )


def connection_ips(addresses: Iterable[Multiaddr]) -> set[str]:
    """The IP addresses in multiaddrs (p2pd's `list_peers` gives a peer's connections' remote addresses)."""
    ips = set()
    for maddr in addresses:
        for code in (protocols.P_IP4, protocols.P_IP6):
            try:
                ips.add(str(ipaddress.ip_address(maddr.value_for_protocol(code))))
            except Exception:  # not in this multiaddr, or not an address
                continue
    return ips


def dialable(offer: ds.DirectOffer, p2p_ips: Collection[str]) -> ds.DirectOffer:
    """`offer` with only the hosts the client may dial: any address another machine can have, and an address of
    this machine or its link (`_only_here`) only where p2p reached the server at it (`p2p_ips`: its connections'
    remote IPs, e.g. a loopback swarm). ValueError when none is left."""
    reached = {str(ipaddress.ip_address(ip)) for ip in p2p_ips}
    hosts = tuple(h for h in offer.hosts if not _only_here(h) or str(ipaddress.ip_address(h)) in reached)
    if not hosts:
        raise ValueError(
            f"the direct offer's hosts {list(offer.hosts)} are local to the client (p2p: {sorted(reached)})"
        )
    return dataclasses.replace(offer, hosts=hosts)


class DirectInferenceStream(FramedSocketStream):
    """One `rpc_inference` stream over a server's direct port (sealed frames once open)."""

    _sealer: ds.Sealer | None = None
    _opener: ds.Opener | None = None

    @classmethod
    async def open(
        cls, offer: ds.DirectOffer, peer_id: str, *, timeout_s: float, rpc: str = "rpc_inference"
    ) -> DirectInferenceStream | None:
        """Connects to the first of the offer's hosts that answers and completes the handshake for `rpc`; None if none
        does (then nothing was sent but the handshake)."""
        for host in offer.hosts:
            stream = await cls._open_at(host, offer, peer_id, timeout_s, rpc)
            if stream is not None:
                return stream
        return None

    @classmethod
    async def _open_at(
        cls, host: str, offer: ds.DirectOffer, peer_id: str, timeout_s: float, rpc: str
    ) -> DirectInferenceStream | None:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        stream = cls(sock, peer_id, rpc)
        loop = asyncio.get_running_loop()
        hello = ds.DirectHello(
            rpc=rpc, peer_id=peer_id, token=offer.ticket.token, client_nonce=os.urandom(ds.NONCE_BYTES)
        )
        try:
            await asyncio.wait_for(loop.sock_connect(sock, (host, offer.port)), timeout_s)
            raw = hello.to_bytes()
            server_nonce, server_proof = ds.parse_challenge(await say_hello(stream, raw, timeout_s))
            keys = ds.StreamKeys.derive(offer.ticket.key, raw, server_nonce)
            if not ds.proof_matches(keys.server_proof, server_proof):
                raise ConnectionError("the server at the direct port does not hold our ticket's key")
            if await say_hello(stream, keys.client_proof, timeout_s):  # ACCEPT (empty) or ERROR: a full server, say
                raise ConnectionError("the direct port's last ACCEPT is not empty")
        except (OSError, EOFError, ValueError, asyncio.TimeoutError) as e:
            logger.debug(f"direct_transport.unavailable(peer=...{peer_id[-6:]}, host={host}, error={e!r})")
            stream.close()
            return None
        stream._sealer = ds.Sealer(keys.client_to_server)
        stream._opener = ds.Opener(keys.server_to_client)
        return stream

    # ---- framing (sealed once open)

    def _request_frame(self, payload: bytes) -> bytes:
        assert self._sealer is not None, "the stream is not open"
        return self._sealer.seal(ls.MESSAGE, payload)

    def _end_frame(self) -> bytes:
        assert self._sealer is not None, "the stream is not open"
        return self._sealer.seal(ls.END)

    def _header(self, buffer: bytearray, max_payload_bytes: int) -> tuple[int, int]:
        return ls.parse_header(buffer, max_payload_bytes + ds.TAG_BYTES)

    def _response(self, kind: int, payload: bytes) -> runtime_pb2.ExpertResponse | None:
        assert self._opener is not None, "the stream is not open"
        try:
            opened = self._opener.open(kind, payload)
        except ValueError as e:  # changed, dropped or replayed bytes: this stream is unusable
            raise ConnectionError(f"direct stream from ...{self.peer_id[-6:]}: {e}") from None
        return frame_response(kind, opened, self.peer_id, "direct", self.rpc)


async def open_direct(
    offers: DirectOffers, peer_id: str, *, timeout_s: float, rpc: str = "rpc_inference"
) -> DirectInferenceStream | None:
    """A stream of `rpc` on `peer_id`'s direct port with the kept ticket, else with a fresh one (the server may have
    restarted and forgotten the old); None (and p2p with this server for a while) if neither works."""
    kept = await offers.get(peer_id)
    if kept is None:
        return None
    stream = await DirectInferenceStream.open(kept, peer_id, timeout_s=timeout_s, rpc=rpc)
    if stream is None:
        fresh = await offers.get(peer_id, fresh=True)
        if fresh is not None and fresh.ticket != kept.ticket:
            stream = await DirectInferenceStream.open(fresh, peer_id, timeout_s=timeout_s, rpc=rpc)
    if stream is None:
        offers.unusable(peer_id)
    return stream


class DirectOffers:
    """Each server's direct offer (or that it has none), for the client's sessions, of the latest
    `peer_tables.PEERS_KEPT_MAX` servers asked (an older one is asked again). `ask(peer_id)` runs the ticket
    RPC over p2p (the caller's code: it knows the p2p instance and the membership proof)."""

    def __init__(self, ask: Callable[[str], Awaitable[ds.DirectOffer]], *, time_fn: Callable[[], float] = time.time):
        self._ask = ask
        self._time = time_fn
        self._offers: dict[str, ds.DirectOffer] = {}
        self._none_until: dict[str, float] = {}

    async def get(self, peer_id: str, *, fresh: bool = False) -> ds.DirectOffer | None:
        """A usable offer of `peer_id`, or None (no direct port, not reachable lately, or the RPC failed); `fresh`
        asks the server again even if a ticket is kept (a restarted server no longer knows its old tickets)."""
        now = self._time()
        if self._none_until.get(peer_id, 0.0) > now:
            return None
        offer = self._offers.get(peer_id)
        if not fresh and offer is not None and offer.ticket.expires_at_s - RENEW_BEFORE_EXPIRY_S > now:
            return offer
        try:
            offer = await self._ask(peer_id)
        except Exception as e:  # a Petals server, a server without a direct port, a hostile answer
            logger.debug(f"direct_transport.no_offer(peer=...{peer_id[-6:]}): {e!r}")
            self.unusable(peer_id)
            return None
        remember(self._offers, peer_id, offer)
        return offer

    def unusable(self, peer_id: str) -> None:
        """`peer_id`'s direct port did not work: use p2p with it for `NO_DIRECT_RETRY_S`."""
        self._offers.pop(peer_id, None)
        remember(self._none_until, peer_id, self._time() + NO_DIRECT_RETRY_S)
