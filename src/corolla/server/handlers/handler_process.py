"""One handler process of `--num_handlers` > 1: its own asyncio loop on a P2P replica of the server's p2pd, running the
same front as the one-process server (`front_service.FrontService`, registered balanced: p2pd spreads incoming
streams over the processes that registered a name), talking to the core in the device process through `RemoteCore`,
the one front-to-core seam over its channel (`device_channel` there). The process lives as long as its
channel: when the device process closes it or dies, the handler ends its sessions, unregisters and exits (no
orphans)."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
from multiprocessing.connection import Connection

from hivemind.p2p import P2P
from hivemind.utils.multiaddr import Multiaddr

from corolla.server.front.front_service import FrontService, FrontSettings
from corolla.server.front.handler import TransformerConnectionHandler
from corolla.server.handlers.remote_core import DeviceLink, RemoteCore
from corolla.server.metrics import ServerMetrics
from corolla.utils import busy_poll
from corolla.utils.logging import get_logger

logger = get_logger(__name__)


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


def stream_handle_names(handler: TransformerConnectionHandler) -> list[str]:
    """The handle names p2pd routes as streams to this process (a dead process's must be unregistered)."""
    handler._collect_rpc_handlers()
    return [
        handler._get_handle_name(None, rpc.method_name)
        for rpc in handler._rpc_handlers
        if rpc.stream_input or rpc.stream_output
    ]


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
    front = FrontService(settings, RemoteCore(link), ForwardedMetrics(link), index=index)
    p2p = await P2P.replicate(Multiaddr(daemon_listen_maddr))
    try:
        await front.start(p2p)
        if link.closed.is_set():  # stopped while starting
            return
        # where p2pd sends our streams, and their names
        link.note("ready", os.getpid(), str(p2p._client_listen_maddr), tuple(stream_handle_names(front.handler)))
        logger.info(f"handler_process.ready(index={index}, pid={os.getpid()})")
        await link.closed.wait()
    finally:
        logger.info(f"handler_process.stopping(index={index}, sessions={front.handler.sessions.num_open})")
        await front.stop()
        await link.close()
        try:
            await asyncio.wait_for(p2p.shutdown(), 5.0)
        except Exception as e:
            logger.debug(f"handler_process.p2p_shutdown_failed({e!r})")
