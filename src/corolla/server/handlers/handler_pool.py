"""`--num_handlers N` (N > 1): N handler processes, forked from a forkserver that imported the handler module once, own
the p2p streams (registered `balanced=True` on P2P replicas of the server's p2pd); the device process keeps all session
state. A process that dies, or stops reading its channel (killed: decision 0258), is restarted; more than
`MAX_RESTARTS_PER_MINUTE` deaths mark the pool failed (`healthy`), and the server restarts its serving part. Stopping
closes every channel; a process not gone within `stop_timeout_s` is killed."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import socket
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from multiprocessing.context import BaseContext
from multiprocessing.process import BaseProcess

from hivemind.p2p.p2p_daemon_bindings.control import DaemonConnector
from hivemind.p2p.p2p_daemon_bindings.utils import raise_if_failed, read_pbmsg_safe, write_pbmsg
from hivemind.proto import p2pd_pb2 as p2pd_pb
from hivemind.utils.multiaddr import Multiaddr

from corolla.server.core.span_core import SpanCore
from corolla.server.front.front_settings import FrontSettings
from corolla.server.handlers.device_channel import ChannelIntake, DeviceChannel
from corolla.utils.logging import get_logger

logger = get_logger(__name__)

MAX_RESTARTS_PER_MINUTE = 5
START_TIMEOUT_S = 120.0


# a handler process's entry point: (its front's settings, the server's p2pd control socket, its index, its end of the
# channel) -> None; a module-level function, whose module the forkserver imports once (`front_service.main`, passed
# by the span service)
HandlerMain = Callable[[FrontSettings, str, int, Connection], None]


def _context(main: HandlerMain) -> BaseContext:
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload([main.__module__])
    return context


async def remove_stream_handlers(daemon_listen_maddr: str, client_listen_maddr: str, names: list[str]) -> None:
    """Unregisters a dead handler process's stream handlers from p2pd (else p2pd keeps dealing it streams that
    fail); its unary handlers went with its control connection."""
    if not client_listen_maddr:
        return
    connector = DaemonConnector(Multiaddr(daemon_listen_maddr))
    for name in names:
        try:
            reader, writer = await connector.open_connection()
            request = p2pd_pb.Request(
                type=p2pd_pb.Request.REMOVE_STREAM_HANDLER,
                removeStreamHandler=p2pd_pb.RemoveStreamHandlerRequest(
                    addr=Multiaddr(client_listen_maddr).to_bytes(), proto=[name]
                ),
            )
            await write_pbmsg(writer, request)
            response = p2pd_pb.Response()
            await read_pbmsg_safe(reader, response)
            writer.close()
            raise_if_failed(response)
        except Exception as e:
            logger.warning(f"handler_pool.unregister_failed(name={name}): {e!r}")


class HandlerPool:
    """The handler processes of one span and their channels (see the module docstring)."""

    def __init__(
        self,
        num_handlers: int,
        settings: FrontSettings,
        main: HandlerMain,
        daemon_listen_maddr: str,
        *,
        core: SpanCore,
        span: tuple[int, ...],
        max_frame_bytes: int,
        stop_timeout_s: float = 10.0,
    ):
        if num_handlers < 2:
            raise ValueError(f"a handler pool needs num_handlers >= 2, got {num_handlers} (1 = no pool)")
        self.main, self.daemon_listen_maddr = main, daemon_listen_maddr
        self.num_handlers, self.settings, self.core = num_handlers, settings, core
        self.span, self.max_frame_bytes = span, max_frame_bytes
        self.stop_timeout_s = stop_timeout_s
        self.processes: list[BaseProcess | None] = [None] * num_handlers
        self.channels: list[DeviceChannel | None] = [None] * num_handlers
        self.intake = ChannelIntake()  # one thread reads every channel (device_channel says why)
        self._tasks: list[asyncio.Task[None]] = []
        self._deaths: list[float] = []
        self.num_restarts = 0
        self.failed = False
        self._stopping = False

    @property
    def healthy(self) -> bool:
        return not self.failed

    @property
    def pids(self) -> list[int]:
        return [p.pid or 0 for p in self.processes if p is not None]

    async def start(self) -> None:
        """Starts every handler process and waits until each has registered its handlers."""
        self.core.drain.on_start.append(self.broadcast_state)  # a drain reaches every process at once
        started = [await self._spawn(i) for i in range(self.num_handlers)]
        waits = [asyncio.ensure_future(c.ready.wait()) for c in started]
        done, pending = await asyncio.wait(waits, timeout=START_TIMEOUT_S)
        if pending:
            for w in pending:
                w.cancel()
            await self.stop()
            raise RuntimeError(f"{len(pending)} of {self.num_handlers} handler processes did not start in time")
        logger.info(f"handler_pool.started(num_handlers={self.num_handlers}, pids={self.pids})")

    async def _spawn(self, index: int) -> DeviceChannel:
        context = _context(self.main)
        ours, theirs = context.Pipe(duplex=True)
        process = context.Process(  # type: ignore[attr-defined]
            target=self.main,
            args=(self.settings, self.daemon_listen_maddr, index, theirs),
            name=f"corolla-handler-{index}",
            daemon=True,
        )
        await asyncio.to_thread(process.start)
        theirs.close()
        sock = socket.socket(fileno=os.dup(ours.fileno()))
        ours.close()
        channel = DeviceChannel(
            index, sock, core=self.core, span=self.span, max_frame_bytes=self.max_frame_bytes, intake=self.intake,
            on_sessions_changed=self.broadcast_state,
        )  # fmt: skip
        self.processes[index], self.channels[index] = process, channel
        self._tasks.append(asyncio.create_task(self._serve(index, process, channel)))
        return channel

    async def _serve(self, index: int, process: BaseProcess, channel: DeviceChannel) -> None:
        await channel.serve()  # returns when the channel ends: a stop, the process died, or it stopped reading
        if self._stopping:
            return
        if channel.io.failure is not None:  # it stopped reading (wedged, stopped): it will not see its channel's end
            logger.error(f"handler_pool.kill(index={index}, pid={process.pid}): {channel.io.failure}")
            process.kill()
        await asyncio.to_thread(process.join, 5.0)
        if self._stopping:
            return
        now = time.monotonic()
        self._deaths = [t for t in self._deaths if now - t < 60.0] + [now]
        logger.error(
            f"handler_pool.handler_died(index={index}, pid={process.pid}, exitcode={process.exitcode}, "
            f"deaths_last_minute={len(self._deaths)})"
        )
        await remove_stream_handlers(self.daemon_listen_maddr, channel.listen_maddr, channel.stream_names)
        if len(self._deaths) > MAX_RESTARTS_PER_MINUTE:
            self.failed = True
            logger.error("handler_pool.failed(reason=handler processes keep dying): the server restarts serving")
            return
        try:
            await self._spawn(index)
            self.num_restarts += 1
        except Exception as e:
            self.failed = True
            logger.error(f"handler_pool.restart_failed(index={index}): {e!r}")

    def broadcast_state(self) -> None:
        """A session opened or closed, or the drain started: every handler process learns the core's figures."""
        for channel in self.channels:
            if channel is not None and not channel.io.closed:
                channel.send_state()

    async def stop(self) -> None:
        """Closes every channel and waits for the processes to exit (killing any that does not)."""
        self._stopping = True
        if self.broadcast_state in self.core.drain.on_start:
            self.core.drain.on_start.remove(self.broadcast_state)
        for channel in self.channels:
            if channel is not None:
                channel.close()
        for task in list(self._tasks):
            try:
                await asyncio.wait_for(asyncio.shield(task), self.stop_timeout_s)
            except (asyncio.TimeoutError, Exception) as e:
                logger.debug(f"handler_pool.channel_stop_failed({e!r})")
        for process in self.processes:
            if process is None:
                continue
            await asyncio.to_thread(process.join, self.stop_timeout_s)
            if process.is_alive():
                logger.warning(f"handler_pool.kill(pid={process.pid}): did not exit within {self.stop_timeout_s} s")
                process.kill()
                await asyncio.to_thread(process.join, 5.0)
        await asyncio.to_thread(self.intake.close)
        logger.info(f"handler_pool.stopped(num_handlers={self.num_handlers}, restarts={self.num_restarts})")
