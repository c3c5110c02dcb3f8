"""One front: the transports of one process (the seven Petals RPCs on p2p, the same-host socket, the direct port) over
one `TransformerConnectionHandler`, which reaches the core through one `span_core.CoreClient`: the `SpanCore` itself in
the core's process (N = 1), `RemoteCore` in a handler process (`main`, the process's entry point). A handler process
lives as long as its channel: when the device process closes it or dies, the front ends its sessions and exits."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from hivemind.p2p import P2P, PeerID
from hivemind.utils.multiaddr import Multiaddr

from corolla.protocol.direct_stream import TicketSecret
from corolla.server.core.peer_bytes import StreamLender
from corolla.server.core.span_core import CoreClient
from corolla.server.front.connection_balance import ConnectionHandoff
from corolla.server.front.direct_endpoint import DirectEndpoint
from corolla.server.front.front_settings import FrontSettings
from corolla.server.front.handler import TransformerConnectionHandler
from corolla.server.front.local_endpoint import LocalEndpoint
from corolla.server.front.peer_auth import make_peer_auth
from corolla.server.front.prefix_keys import PrefixTrust
from corolla.server.handlers.remote_core import DeviceLink, RemoteCore
from corolla.server.metrics import ServerMetrics
from corolla.swarm.membership import load_swarm_key
from corolla.utils import busy_poll
from corolla.utils.logging import get_logger
from corolla.utils.long_lived import freeze_long_lived

logger = get_logger(__name__)


class FrontService:
    """One front (see the module docstring). `index`: the handler process it runs in (None: the core's process)."""

    def __init__(
        self, settings: FrontSettings, core: CoreClient, metrics: ServerMetrics, *, index: int | None = None,
        stream_lender: StreamLender | None = None,
    ):  # fmt: skip
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
            stream_lender=stream_lender,  # a handler process's stream bytes are lent by the core (per server caps)
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
                                     index=self.index, pace=self.handler.peer_limits.message_pace)  # fmt: skip
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


# ---- a front in a handler process of its own (`--num_handlers` N > 1; `handlers.handler_pool` starts it)


class ForwardedMetrics(ServerMetrics):
    """Refusal counts go to the device process, which exports one set of metrics for the server (it counts the
    sessions itself: its core opens them)."""

    def __init__(self, link: DeviceLink):
        super().__init__()
        self.link = link

    def rejected(self, reason: str) -> None:
        self.link.note("rejected", reason)

    def prefix_probe(self, *, keyed_tokens: int, hit_tokens: int) -> None:
        self.link.note("prefix_probe", keyed_tokens, hit_tokens)


def main(settings: FrontSettings, daemon_listen_maddr: str, index: int, channel: Connection) -> None:
    """The process's entry point (multiprocessing): serves until the channel to the device process ends."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C goes to the server, which closes the channel
    sock = socket.socket(fileno=os.dup(channel.fileno()))
    channel.close()
    busy_poll.run(_serve(settings, daemon_listen_maddr, index, sock), loop_selector(settings))


def loop_selector(settings: FrontSettings) -> busy_poll.BusyPollSelector | None:
    """The selector of the process's loop: one that lingers after each message (`poll_linger_s`), or None (the
    default selector: it sleeps at once)."""
    return busy_poll.BusyPollSelector(linger_s=settings.poll_linger_s) if settings.poll_linger_s > 0.0 else None


async def _serve(settings: FrontSettings, daemon_listen_maddr: str, index: int, sock: socket.socket) -> None:
    link = await DeviceLink.open(sock)
    # sessions are admitted, steps run and pushes routed by the device process's core
    core = RemoteCore(link)
    front = FrontService(settings, core, ForwardedMetrics(link), index=index, stream_lender=core)
    p2p = await P2P.replicate(Multiaddr(daemon_listen_maddr))
    try:
        await front.start(p2p)
        if link.closed.is_set():  # stopped while starting
            return
        # where p2pd sends our streams, and their names (a dead process's must be unregistered)
        streams = tuple(name for name, is_stream in front.handler.handle_names().items() if is_stream)
        freeze_long_lived()  # what the process made to start lives as long as it (utils.long_lived)
        link.note("ready", os.getpid(), str(p2p._client_listen_maddr), streams)
        logger.info(f"front_service.handler_ready(index={index}, pid={os.getpid()})")
        await link.closed.wait()
    finally:
        logger.info(f"front_service.handler_stopping(index={index}, sessions={front.handler.sessions.num_open})")
        await front.stop()
        await link.close()
        try:
            await asyncio.wait_for(p2p.shutdown(), 5.0)
        except Exception as e:
            logger.debug(f"front_service.p2p_shutdown_failed({e!r})")
