"""One handler process of `--num_handlers` > 1: its own asyncio loop on a P2P replica of the server's p2pd, the
same `TransformerConnectionHandler` as the one-process server registered with `balanced=True` (p2pd spreads
incoming streams over the processes that registered a name), talking to the core in the device process through
`RemoteCore`, the one front-to-core seam over its channel (`device_channel` there). The process lives as long as its
channel: when the device process closes it or dies, the handler ends its sessions, unregisters and exits (no
orphans)."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
from multiprocessing.connection import Connection
from pathlib import Path

from hivemind.p2p import P2P, PeerID
from hivemind.utils.multiaddr import Multiaddr

from corolla.protocol import channel_frames as wire
from corolla.protocol.direct_stream import TicketSecret
from corolla.server.front.connection_balance import ConnectionHandoff
from corolla.server.front.direct_endpoint import DirectEndpoint
from corolla.server.front.handler import TransformerConnectionHandler
from corolla.server.front.local_endpoint import LocalEndpoint
from corolla.server.front.peer_auth import make_peer_auth
from corolla.server.handlers.handler_settings import HandlerSettings
from corolla.server.handlers.remote_core import DeviceLink, RemoteCore
from corolla.server.metrics import ServerMetrics
from corolla.swarm.membership import load_swarm_key
from corolla.utils import busy_poll
from corolla.utils.logging import get_logger

logger = get_logger(__name__)


class ForwardedMetrics(ServerMetrics):
    """Refusal counts go to the device process, which exports one set of metrics for the server (it counts the
    sessions itself: its core opens them)."""

    def __init__(self, link: DeviceLink):
        super().__init__()
        self.link = link

    def _send(self, event: int, label: str = "") -> None:
        if not self.link.closed.is_set():
            self.link.send(wire.METRICS, 0, wire.Writer().u8(event).text(label))

    def rejected(self, reason: str) -> None:
        self._send(wire.METRIC_REJECTED, reason)

    def prefix_probe(self, *, keyed_tokens: int, hit_tokens: int) -> None:
        if not self.link.closed.is_set():
            body = wire.Writer().u8(wire.METRIC_PREFIX_PROBE).text("").u32(keyed_tokens).u32(hit_tokens)
            self.link.send(wire.METRICS, 0, body)


def stream_handle_names(handler: TransformerConnectionHandler) -> list[str]:
    """The handle names p2pd routes as streams to this process (a dead process's must be unregistered)."""
    handler._collect_rpc_handlers()
    return [
        handler._get_handle_name(None, rpc.method_name)
        for rpc in handler._rpc_handlers
        if rpc.stream_input or rpc.stream_output
    ]


def main(settings: HandlerSettings, index: int, channel: Connection) -> None:
    """The process's entry point (multiprocessing): serves until the channel to the device process ends."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C goes to the server, which closes the channel
    sock = socket.socket(fileno=os.dup(channel.fileno()))
    channel.close()
    busy_poll.run(_serve(settings, index, sock), loop_selector(settings))


def loop_selector(settings: HandlerSettings) -> busy_poll.BusyPollSelector | None:
    """The selector of the process's loop: one that lingers after each message (`poll_linger_s`), or None (the
    default selector: it sleeps at once)."""
    return busy_poll.BusyPollSelector(linger_s=settings.poll_linger_s) if settings.poll_linger_s > 0.0 else None


async def _serve(settings: HandlerSettings, index: int, sock: socket.socket) -> None:
    link = await DeviceLink.open(sock)
    metrics = ForwardedMetrics(link)
    handler = TransformerConnectionHandler(
        limits=settings.limits,
        core=RemoteCore(link),  # sessions are admitted, steps run and pushes routed by the device process's core
        timeouts=settings.timeouts,
        compression=settings.compression,
        dht_client_mode=settings.dht_client_mode,
        metrics=metrics,
        peer_limits=settings.peer_limits,
        peer_auth=make_peer_auth(load_swarm_key(settings.swarm_key_file), settings.peer_id, metrics),
    )
    handler.handoff.enabled = settings.kv_handoff
    p2p = await P2P.replicate(Multiaddr(settings.daemon_listen_maddr))
    endpoint: LocalEndpoint | None = None
    direct: DirectEndpoint | None = None
    try:
        await handler.add_p2p_handlers(p2p, balanced=True)
        if link.closed.is_set():  # stopped while starting
            return
        if settings.local_socket_dir is not None:
            endpoint = await _start_endpoint(handler, settings, index)
        if settings.direct is not None:
            direct = await _start_direct(handler, settings, index)
        ready = wire.Writer().u32(os.getpid()).text(str(p2p._client_listen_maddr))  # where p2pd sends our streams
        names = stream_handle_names(handler)
        ready.u8(len(names))
        for name in names:
            ready.text(name)
        link.send(wire.READY, 0, ready)
        logger.info(f"handler_process.ready(index={index}, pid={os.getpid()})")
        await link.closed.wait()
    finally:
        logger.info(f"handler_process.stopping(index={index}, sessions={handler.sessions.num_open})")
        for stopping in (endpoint, direct):
            if stopping is not None:
                await stopping.stop()
        await handler.shutdown()
        try:
            await asyncio.wait_for(handler.remove_p2p_handlers(p2p), 5.0)
        except Exception as e:
            logger.debug(f"handler_process.remove_handlers_failed({e!r})")
        await link.close()
        try:
            await asyncio.wait_for(p2p.shutdown(), 5.0)
        except Exception as e:
            logger.debug(f"handler_process.p2p_shutdown_failed({e!r})")


async def _start_endpoint(
    handler: TransformerConnectionHandler, settings: HandlerSettings, index: int
) -> LocalEndpoint | None:
    """This process's same-host socket, or None where it cannot listen (same-host clients then use p2p)."""
    assert settings.local_socket_dir is not None
    endpoint = LocalEndpoint(
        handler, PeerID.from_base58(settings.peer_id), directory=Path(settings.local_socket_dir), index=index
    )
    try:
        if await endpoint.start():
            return endpoint
    except OSError as e:
        logger.warning(f"handler_process.local_endpoint_failed(index={index}): {e!r}")
    return None


async def _start_direct(
    handler: TransformerConnectionHandler, settings: HandlerSettings, index: int
) -> DirectEndpoint | None:
    """This process's listener on the server's direct port, or None where it cannot listen (clients keep to p2p)."""
    assert settings.direct is not None
    secret = TicketSecret(settings.direct_secret)
    handoff = None
    if settings.direct_balance_dir is not None:
        try:
            handoff = ConnectionHandoff(Path(settings.direct_balance_dir), index)
        except (OSError, ValueError) as e:  # connections stay where the kernel put them
            logger.warning(f"handler_process.direct_balance_unavailable(index={index}): {e!r}")
    endpoint = DirectEndpoint(
        handler, PeerID.from_base58(settings.peer_id), settings.direct, secret, reuse_port=True, handoff=handoff
    )
    try:
        await endpoint.start()
        return endpoint
    except OSError as e:
        logger.warning(f"handler_process.direct_endpoint_failed(index={index}): {e!r}")
    return None
