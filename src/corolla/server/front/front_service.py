"""One front: the transports of one process (the seven Petals RPCs on p2p, the same-host socket, the direct port) over
one `TransformerConnectionHandler`, which reaches the core through one `span_core.CoreClient`. A server runs N >= 1
fronts, every one built here from the same `FrontSettings`: with N = 1 (the default) the one front lives in the
core's process and its client is the `SpanCore` itself (frames reach the core without a socket); with N > 1 each
handler process runs one (`handlers.handler_process`), registered `balanced` on a replica of the server's p2pd, and
its client is `RemoteCore` (the same seam over the process's channel). Only the client differs between topologies."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hivemind.p2p import PeerID

from corolla.protocol.direct_stream import TicketSecret
from corolla.server.core.limits import PeerLimits, SessionTimeouts
from corolla.server.core.span_core import CoreClient
from corolla.server.front.block_functions import ServingLimits
from corolla.server.front.connection_balance import ConnectionHandoff
from corolla.server.front.direct_endpoint import DirectEndpoint, DirectListen
from corolla.server.front.handler import TransformerConnectionHandler
from corolla.server.front.local_endpoint import LocalEndpoint
from corolla.server.front.peer_auth import make_peer_auth
from corolla.server.front.prefix_keys import PrefixTrust
from corolla.server.metrics import ServerMetrics
from corolla.swarm.membership import load_swarm_key
from corolla.utils.logging import get_logger

logger = get_logger(__name__)


@dataclass(frozen=True)
class FrontSettings:
    """What every front of one span serves by (pickled to each handler process)."""

    limits: ServingLimits
    timeouts: SessionTimeouts
    peer_limits: PeerLimits = field(default_factory=PeerLimits)  # this front's stream bytes (the core's: its own)
    compression: int = 0
    dht_client_mode: bool = False
    peer_id: str = ""  # the server's (its p2pd's): every front answers as it
    swarm_key_file: str | None = None  # private swarm: every RPC proves membership
    kv_handoff: bool = True  # a draining session's KV to its client / from a client (`SessionHandoff.enabled`)
    prefix_cache_shared: bool = False  # every client's cached prefixes are everyone's (`PrefixTrust.shared`)
    local_socket_dir: str | None = None  # serve same-host clients on a unix socket there (None: not)
    direct: DirectListen | None = None  # the direct TCP port (handler processes share one, SO_REUSEPORT)
    direct_secret: bytes | None = None  # the server's ticket secret (any front checks any front's tickets)
    direct_balance_dir: str | None = None  # handler processes' direct-port load table and hand-off sockets (0700)
    # a handler process's loop polls instead of sleeping for this long after each message (0: it sleeps at once); its
    # loop is its only Python thread, so polling starves no other (`utils.busy_poll`)
    poll_linger_s: float = 0.0


class FrontService:
    """One front (see the module docstring). `index`: the handler process it runs in (None: the core's process)."""

    def __init__(self, settings: FrontSettings, core: CoreClient, metrics: ServerMetrics, *, index: int | None = None):
        self.settings, self.index = settings, index
        self.handler = TransformerConnectionHandler(
            limits=settings.limits,
            core=core,
            timeouts=settings.timeouts,
            compression=settings.compression,
            dht_client_mode=settings.dht_client_mode,
            metrics=metrics,
            peer_limits=settings.peer_limits,
            peer_auth=make_peer_auth(load_swarm_key(settings.swarm_key_file), settings.peer_id, metrics),
        )
        self.handler.handoff.enabled = settings.kv_handoff
        self.handler.prefix_trust = PrefixTrust(shared=settings.prefix_cache_shared)
        self.p2p: Any = None
        self.local_endpoint: LocalEndpoint | None = None
        self.direct_endpoint: DirectEndpoint | None = None

    async def start(self, p2p: Any) -> None:
        """Registers the RPCs on `p2p` (balanced over the handler processes) and opens the front's endpoints; an
        endpoint that can't listen is left out (its clients use p2p)."""
        self.p2p = p2p
        await self.handler.add_p2p_handlers(p2p, balanced=self.index is not None)
        peer_id = PeerID.from_base58(self.settings.peer_id)
        if self.settings.local_socket_dir is not None:
            endpoint = LocalEndpoint(self.handler, peer_id, directory=Path(self.settings.local_socket_dir),
                                     index=self.index)  # fmt: skip
            try:
                if await endpoint.start():
                    self.local_endpoint = endpoint
            except OSError as e:
                logger.warning(f"front_service.local_endpoint_failed(index={self.index}): {e!r}")
        if self.settings.direct is not None:
            direct = DirectEndpoint(self.handler, peer_id, self.settings.direct, TicketSecret(self.settings.direct_secret),
                                    reuse_port=self.index is not None, handoff=self._handoff())  # fmt: skip
            try:
                await direct.start()
                self.direct_endpoint = direct
            except OSError as e:
                logger.warning(f"front_service.direct_endpoint_failed(index={self.index}): {e!r}")

    def _handoff(self) -> ConnectionHandoff | None:
        """A handler process's end of the direct port's placement by load (None: connections stay where accepted)."""
        if self.index is None or self.settings.direct_balance_dir is None:
            return None
        try:
            return ConnectionHandoff(Path(self.settings.direct_balance_dir), self.index)
        except (OSError, ValueError) as e:
            logger.warning(f"front_service.direct_balance_unavailable(index={self.index}): {e!r}")
            return None

    async def stop(self, timeout_s: float = 5.0) -> None:
        """Closes the endpoints, unregisters the RPCs and ends every session of this front (freeing its cache)."""
        for endpoint in (self.local_endpoint, self.direct_endpoint):
            if endpoint is not None:
                await endpoint.stop()
        self.local_endpoint = self.direct_endpoint = None
        if self.p2p is not None:
            try:
                await asyncio.wait_for(self.handler.remove_p2p_handlers(self.p2p), timeout_s)
            except Exception as e:
                logger.debug(f"front_service.remove_handlers_failed({e!r})")
            self.p2p = None
        await self.handler.shutdown()
