"""`DirectEndpoint`: serves `rpc_inference` to corolla clients on the server's direct TCP port (`--direct_port`; the
handshake, sealed frames and connection limits are docs/contracts.md's `direct_stream`), through the handler's own
`serve_steps` as the p2p stream does: the stream's peer is the one its ticket (fetched over p2p) was issued to, under
that peer's limits. The endpoint accepts itself (`loop.sock_accept`), so that with handler processes a connection is
placed by load (`connection_balance`) before any transport reads it."""

from __future__ import annotations

import asyncio
import os
import socket
from collections import defaultdict
from dataclasses import dataclass
from typing import Protocol

from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import runtime_pb2
from hivemind.utils import MSGPackSerializer

from corolla.protocol import direct_stream as ds
from corolla.protocol import local_stream as ls
from corolla.server.core.limits import PeerLimits
from corolla.server.core.peer_bytes import StreamBudget
from corolla.server.front.connection_balance import ConnectionHandoff
from corolla.server.front.peer_auth import PeerAuth, info_uid, remote_peer
from corolla.server.front.stream_endpoint import (
    HELLO_TIMEOUT_S,
    AcceptedStream,
    Connections,
    FrameConnection,
    StreamRpcs,
    check_hello,
    read_hello,
    serve_connection,
)
from corolla.server.metrics import ServerMetrics
from corolla.utils.logging import get_logger

logger = get_logger(__name__)

MAX_PENDING_HELLOS = 64
SPARE_CONNECTIONS_PER_PEER = 4  # a client replacing sessions may briefly hold a few more connections than sessions
LISTEN_BACKLOG = 512
ACCEPT_ERROR_PAUSE_S = 0.1  # after a failed accept (out of descriptors, say), before the next
STREAM_LIMIT_BYTES = 1 << 16  # unread bytes past a frame's that pause reading (`FrameConnection`)


@dataclass(frozen=True)
class DirectListen:
    """Where a server's direct port listens and what it tells clients to connect to."""

    bind_host: str  # e.g. "0.0.0.0" behind a forwarded port, or the one address to listen on
    port: int  # 0: any free port (the device process picks one for all handler processes)
    hosts: tuple[str, ...]  # addresses clients connect to (what the ticket RPC offers)

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"direct port must be 0-65535, got {self.port}")
        if not 0 < len(self.hosts) <= ds.MAX_HOSTS:
            raise ValueError(f"a direct port is offered at 1-{ds.MAX_HOSTS} hosts, got {len(self.hosts)}")

    def with_free_port(self) -> DirectListen:
        """The same with `port` fixed to a port free now (so every handler process binds the same one)."""
        if self.port:
            return self
        family = socket.AF_INET6 if ":" in self.bind_host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.bind((self.bind_host, 0))
            port = probe.getsockname()[1]
        return DirectListen(self.bind_host, port, self.hosts)


class ConnectionShareExceeded(ValueError):
    """A ticket holder past its share of direct connections, or the server past its total."""


class WrongProof(ValueError):
    """A hello with a good token whose sender could not prove the ticket's key (one who saw the token on the wire)."""


class DirectTicketRpc:
    """The handler's ticket RPC (a mixin of `server.handler.TransformerConnectionHandler`). `direct_offer` is set
    where a direct endpoint listens; until then the RPC refuses and clients keep to p2p."""

    direct_offer: tuple[DirectListen, ds.TicketSecret] | None = None
    peer_auth: PeerAuth | None

    async def rpc_direct_ticket(self, request: runtime_pb2.ExpertUID, context: P2PContext) -> runtime_pb2.ExpertInfo:
        info_uid(self.peer_auth, context, request.uid)  # private swarm: the caller proves membership on the uid
        sender = remote_peer(context)
        if self.direct_offer is None or sender is None:
            raise ValueError("this server has no direct port")
        listen, secret = self.direct_offer
        offer = ds.DirectOffer(hosts=listen.hosts, port=listen.port, ticket=secret.issue(sender))
        return runtime_pb2.ExpertInfo(serialized_info=MSGPackSerializer.dumps(offer.to_dict()))


class DirectFront(StreamRpcs, Protocol):
    """What the direct port needs of the front it serves (`handler.TransformerConnectionHandler`): its
    `serve_steps`, the offer its ticket RPC hands out, its metrics, per-peer limits and stream byte budget."""

    direct_offer: tuple[DirectListen, ds.TicketSecret] | None
    metrics: ServerMetrics
    peer_limits: PeerLimits
    stream_budget: StreamBudget


class SealedFrames:
    """A direct connection's frames after the handshake: sealed to the client, opened from it."""

    overhead_bytes = ds.TAG_BYTES

    def __init__(self, keys: ds.StreamKeys):
        self._sealer = ds.Sealer(keys.server_to_client)
        self._opener = ds.Opener(keys.client_to_server)

    def encode(self, kind: int, payload: bytes) -> list[bytes]:
        return [self._sealer.seal(kind, payload)]

    def decode(self, kind: int, payload: bytes) -> bytes:
        return self._opener.open(kind, payload)

    def message_head(self, nbytes: int) -> bytes | None:
        return None  # (a payload goes out sealed)


class DirectEndpoint:
    """The direct TCP listener of one handler (see the module docstring)."""

    def __init__(
        self,
        handler: DirectFront,
        peer_id: PeerID,
        listen: DirectListen,
        secret: ds.TicketSecret,
        *,
        reuse_port: bool,
        handoff: ConnectionHandoff | None = None,
    ):
        if not listen.port and reuse_port:
            raise ValueError("handler processes share one direct port: fix it first (DirectListen.with_free_port)")
        self.handler, self.peer_id, self.listen, self.secret = handler, peer_id, listen, secret
        self.peer_id_b58 = peer_id.to_base58()
        self.reuse_port = reuse_port
        self.handoff = handoff  # this handler process's end of the placement by load (None: keep every connection)
        self._listeners: list[socket.socket] = []
        self._accepting: list[asyncio.Task[None]] = []
        self._stopping = False
        self.max_frame_bytes = int(handler.max_stream_bytes) + (1 << 20)
        self.port: int | None = None
        self.streams_opened = 0
        self.refused = 0
        self._pending = 0
        self._per_peer: dict[str, int] = defaultdict(int)
        self.connections = Connections()

    @property
    def num_open(self) -> int:
        return self.connections.num_open

    async def start(self) -> int:
        """Listens; returns the port. The handler's ticket RPC offers it from now on."""
        try:
            self._listeners = _listening_sockets(self.listen.bind_host, self.listen.port, self.reuse_port)
            if self.handoff is not None:
                self.handoff.start(self._adopt)
        except BaseException:
            await self.stop()
            raise
        self._accepting = [asyncio.create_task(self._accept_loop(sock)) for sock in self._listeners]
        self.port = self._listeners[0].getsockname()[1]
        self.handler.direct_offer = (DirectListen(self.listen.bind_host, self.port, self.listen.hosts), self.secret)
        logger.info(f"direct_endpoint.listening(host={self.listen.bind_host}, port={self.port}, pid={os.getpid()})")
        return self.port

    async def stop(self) -> None:
        """Stops offering tickets and accepting, and ends open streams (their sessions free their caches)."""
        self.handler.direct_offer = None
        self._stopping = True
        for task in self._accepting:
            task.cancel()
        if self._accepting:
            await asyncio.wait(self._accepting)
        self._accepting = []
        for sock in self._listeners:
            sock.close()
        self._listeners = []
        if self.handoff is not None:
            self.handoff.stop_receiving()
        await self.connections.close()
        if self.handoff is not None:  # after the connections: each releases its count as it ends
            self.handoff.close()

    async def _accept_loop(self, listener: socket.socket) -> None:
        """Accepts until cancelled; each connection is placed (here or, by load, in another handler process) before
        anything reads from it."""
        loop = asyncio.get_running_loop()
        while True:
            try:
                conn, _ = await loop.sock_accept(listener)
            except OSError as e:  # out of descriptors, say: the backlog waits
                logger.warning(f"direct_endpoint.accept_failed({e!r})")
                await asyncio.sleep(ACCEPT_ERROR_PAUSE_S)
                continue
            if self.handoff is None or self.handoff.place(conn):
                self._adopt(conn)

    def _adopt(self, conn: socket.socket) -> None:
        """Serves a connection accepted here or handed here, in its own task."""
        if self._stopping:
            conn.close()
            if self.handoff is not None:
                self.handoff.release()
            return
        asyncio.get_running_loop().create_task(self._connect(conn))

    async def _connect(self, conn: socket.socket) -> None:
        """Makes streams of a connection accepted or handed here, then serves it in a task of its own
        (`stream_endpoint.serve_connection`: this endpoint's code is not on each step's way)."""
        loop = asyncio.get_running_loop()
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            _, stream = await loop.connect_accepted_socket(lambda: FrameConnection(STREAM_LIMIT_BYTES), conn)
        except OSError as e:
            conn.close()
            logger.debug(f"direct_endpoint.adopt_failed({e!r})")
            self.ended(None)
            return
        if self._stopping:
            stream.close()
            self.ended(None)
            return
        loop.create_task(serve_connection(self, stream))

    async def accept(self, conn: FrameConnection) -> AcceptedStream | None:
        """The connection's hello checked against its ticket and the peer's connection share, and answered
        (`stream_endpoint.StreamListener`)."""
        if self._pending >= MAX_PENDING_HELLOS:
            self._refused("pending", f"{MAX_PENDING_HELLOS} connections are still to say hello")
            return None
        self._pending += 1
        try:
            accepted = await self._accept(conn)
        finally:
            self._pending -= 1
        if accepted is None:
            return None
        peer, keys, rpc = accepted
        self._per_peer[peer] += 1  # (checked in `_accept`, with no await in between)
        self.streams_opened += 1
        context = P2PContext(handle_name=rpc, local_id=self.peer_id, remote_id=PeerID.from_base58(peer))
        budget = self.handler.stream_budget
        idle_s = budget.limits.stream_idle_timeout_s or None
        return AcceptedStream(
            context, SealedFrames(keys), budget.lease(peer), idle_s, peer, pace=budget.limits.message_pace
        )

    def ended(self, accepted: AcceptedStream | None) -> None:
        """A connection closed: its peer's count and its place (`ConnectionHandoff`) released."""
        peer = accepted.peer if accepted is not None else None
        if peer is not None:
            self._per_peer[peer] -= 1
            if not self._per_peer[peer]:
                del self._per_peer[peer]
        if self.handoff is not None:
            self.handoff.release()

    async def _accept(self, conn: FrameConnection) -> tuple[str, ds.StreamKeys, str] | None:
        """(the ticket's peer, this connection's keys, the rpc it opens) once the client has proved its ticket's key
        and the peer's connection share allows one more (the last ACCEPT sent); None after a refusal (an ERROR frame
        where the client said something) or silence. The whole handshake gets `HELLO_TIMEOUT_S`. Nothing is counted
        against the ticket's peer before its proof checks: anyone on the path can resend a hello it saw."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + HELLO_TIMEOUT_S
        stage = "hello"
        try:
            raw = await read_hello(conn)
            hello = ds.DirectHello.from_bytes(raw)
            check_hello(
                "direct stream", version=hello.version, expected_version=ds.DIRECT_STREAM_VERSION,
                peer_id=hello.peer_id, own_peer_id=self.peer_id_b58, rpc=hello.rpc,
            )  # fmt: skip
            peer, ticket_key = self.secret.check(hello.token)
            server_nonce = os.urandom(ds.NONCE_BYTES)  # fresh for every connection: a recorded answer fits no other
            keys = ds.StreamKeys.derive(ticket_key, raw, server_nonce)
            conn.write(b"".join(ls.frame(ls.ACCEPT, ds.challenge_payload(server_nonce, keys))))
            stage = "proof"
            proof = await read_hello(conn, ds.MAC_BYTES, max(0.0, deadline - loop.time()))
            if not ds.proof_matches(keys.client_proof, proof):
                raise WrongProof("the client did not prove its ticket's key")
            self._check_admission(peer)
        except asyncio.TimeoutError:
            if stage == "hello":
                self._refused("no_hello", f"no hello within {HELLO_TIMEOUT_S} s")
            else:
                self._refused("bad_proof", f"no proof of the ticket's key within {HELLO_TIMEOUT_S} s")
            return None
        except ValueError as e:
            if isinstance(e, ConnectionShareExceeded):
                self._refused("connections", str(e))
            else:
                self._refused("bad_proof" if stage == "proof" else "bad_hello", str(e))
            conn.write(b"".join(ls.frame(ls.ERROR, ls.error_text(e))))
            return None
        conn.write(b"".join(ls.frame(ls.ACCEPT)))
        return peer, keys, hello.rpc

    def _refused(self, reason: str, detail: str) -> None:
        """Counts a refused connection here and in the server's metrics (`corolla_requests_rejected{reason=direct_*}`;
        a handler process forwards it to the device process's one set)."""
        self.refused += 1
        self.handler.metrics.rejected(f"direct_{reason}")
        logger.info(f"direct_endpoint.rejected(reason={reason}): {detail}")

    def _check_admission(self, peer: str) -> None:
        """ConnectionShareExceeded (with the limit) if another connection of `peer` would pass its share or the
        server's."""
        limits = self.handler.peer_limits
        per_peer = limits.max_sessions_per_peer + SPARE_CONNECTIONS_PER_PEER if limits.max_sessions_per_peer else 0
        if per_peer and self._per_peer.get(peer, 0) >= per_peer:
            raise ConnectionShareExceeded(f"this peer already has {per_peer} direct connections open (the limit)")
        total = sum(self._per_peer.values())
        if limits.max_sessions_total and total >= limits.max_sessions_total:
            raise ConnectionShareExceeded(
                f"the server has {total} direct connections open (max_sessions_total); retry later"
            )


def _listening_sockets(host: str, port: int, reuse_port: bool) -> list[socket.socket]:
    """Non-blocking listening sockets on every address `host` resolves to (as `asyncio.start_server` binds)."""
    infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    listeners: list[socket.socket] = []
    try:
        for family, kind, proto, _, address in dict.fromkeys(infos):
            if port:  # every address on the one port (the first one's where `port` was 0)
                address = (address[0], port, *address[2:])
            sock = socket.socket(family, kind, proto)
            listeners.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if reuse_port:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(address)
            sock.listen(LISTEN_BACKLOG)
            sock.setblocking(False)
            port = sock.getsockname()[1]
    except BaseException:
        for sock in listeners:
            sock.close()
        raise
    return listeners
