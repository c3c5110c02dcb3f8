"""`WanProxy`: an asyncio TCP proxy in front of one server. Every accepted connection gets its own connection to
the target and two `_Direction` pumps (client->server, server->client), each with its own `Shaper`: a reader task
reads up to `chunk_bytes` at a time, stamps the chunk with its release time and queues it; a writer task sleeps until
that time and writes it on. A direction holding more than `max_in_flight_bytes` stops reading (the sender's TCP window
fills: back-pressure), so memory stays bounded. End of stream is delayed like data and passed on as a half-close;
a reset on either side closes both. Faults (`stall`, `drop`, `partition`, `heal`: see `faults.LinkFaults`) hold a
connection's bytes, and a new connection's dial to the target, while they last."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
from dataclasses import dataclass

from benchmarks.wan_emulator.config import LinkConfig
from benchmarks.wan_emulator.faults import LinkFaults
from benchmarks.wan_emulator.shaper import Shaper
from corolla.utils.logging import get_logger

logger = get_logger(__name__)

_EOF = b""
FAULT_POLL_S = 0.05  # how often a held connection looks whether its fault ended


@dataclass
class ProxyStats:
    """Counters since the proxy started (bytes are those written onward, after shaping)."""

    connections: int = 0
    bytes_to_target: int = 0
    bytes_from_target: int = 0
    stalls: int = 0
    faults: int = 0  # stalls, drops and partitions applied with `WanProxy.stall/drop/partition`
    resets: int = 0  # connections reset by a drop
    max_in_flight_bytes: int = 0  # the most any one direction ever held


class _Direction:
    """One direction of one connection: reads `reader`, writes `writer`, holds at most about `max_in_flight_bytes`
    (plus one chunk) in between."""

    def __init__(
        self,
        proxy: WanProxy,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        *,
        to_target: bool,
        seed_offset: int,
        peer_port: int,
    ):
        self.proxy = proxy
        self.peer_port = peer_port
        self.reader, self.writer = reader, writer
        self.to_target = to_target
        config = proxy.config
        config = config.for_direction(to_target=to_target)
        seeded = config if config.seed is None else _with_seed(config, config.seed + seed_offset)
        self.shaper = Shaper(seeded)
        self.queue: collections.deque[tuple[float, bytes]] = collections.deque()
        self.in_flight_bytes = 0
        self.changed = asyncio.Event()

    async def read_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            while self.in_flight_bytes >= self.proxy.config.max_in_flight_bytes:  # back-pressure: stop reading
                self.changed.clear()
                await self.changed.wait()
            self.shaper.set_config(self.proxy.config.for_direction(to_target=self.to_target))
            data = await self.reader.read(self.proxy.config.chunk_bytes)
            release_s = self.shaper.release_time(max(1, len(data)), loop.time())
            self.queue.append((release_s, data))
            self.in_flight_bytes += len(data)
            stats = self.proxy.stats
            stats.max_in_flight_bytes = max(stats.max_in_flight_bytes, self.in_flight_bytes)
            self.changed.set()
            if data == _EOF:
                return

    async def write_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            while not self.queue:
                self.changed.clear()
                await self.changed.wait()
            release_s, data = self.queue[0]
            delay_s = release_s - loop.time()
            if delay_s > 0:
                await asyncio.sleep(delay_s)
            await self.proxy.wait_passable(self.peer_port)
            self.queue.popleft()
            if data == _EOF:
                if self.writer.can_write_eof():
                    self.writer.write_eof()
                return
            self.writer.write(data)
            await self.writer.drain()
            self.in_flight_bytes -= len(data)
            if self.to_target:
                self.proxy.stats.bytes_to_target += len(data)
            else:
                self.proxy.stats.bytes_from_target += len(data)
            self.changed.set()

    async def run(self) -> None:
        """Until the end of stream has been passed on; raises what either half raised (a reset)."""
        tasks = [asyncio.ensure_future(self.read_loop()), asyncio.ensure_future(self.write_loop())]
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            for task in done:
                error = task.exception()
                if error is not None:
                    raise error
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            self.proxy.stats.stalls += self.shaper.stalls


def _with_seed(config: LinkConfig, seed: int) -> LinkConfig:
    from dataclasses import replace

    return replace(config, seed=seed)


class WanProxy:
    """`async with WanProxy(target_port=p, config=LinkConfig(delay_ms=25)) as proxy:` listens on `proxy.port`
    (`listen_port=0`: any free one) and forwards each connection to `target_host:target_port` through the emulated
    link. `set_config` changes the link for chunks read from then on. The target is connected per accepted connection
    (it need not be up when the proxy starts); a refused target closes that connection."""

    def __init__(
        self,
        *,
        target_port: int,
        config: LinkConfig | None = None,
        target_host: str = "127.0.0.1",
        listen_host: str = "127.0.0.1",
        listen_port: int = 0,
        connect_timeout_s: float = 10.0,
    ):
        if not 0 < target_port < 65536:
            raise ValueError(f"target_port must be in [1, 65535], got {target_port}")
        if not 0 <= listen_port < 65536:
            raise ValueError(f"listen_port must be in [0, 65535], got {listen_port}")
        self.config = config or LinkConfig()
        self.target_host, self.target_port = target_host, target_port
        self.listen_host, self.listen_port = listen_host, listen_port
        self.connect_timeout_s = connect_timeout_s
        self.stats = ProxyStats()
        self._server: asyncio.Server | None = None
        self._port: int | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._ids = itertools.count()
        self._upstream_ports: set[int] = set()
        self.faults = LinkFaults()
        self._writers: dict[int, list[asyncio.StreamWriter]] = {}  # open connections' sockets, for `drop`

    @property
    def port(self) -> int:
        if self._port is None:
            raise RuntimeError("the proxy is not started")
        return self._port

    @property
    def address(self) -> str:
        return f"{self.listen_host}:{self.port}"

    def upstream_ports(self) -> set[int]:
        """Local ports of the proxy's open connections to the target: what the target sees as its peers' ports (a
        check that nothing reaches the target around the proxy)."""
        return set(self._upstream_ports)

    def set_config(self, config: LinkConfig) -> None:
        self.config = config
        logger.info(f"wan.proxy_config(port={self.port}, {config.describe()})")

    def _now_s(self) -> float:
        return asyncio.get_running_loop().time()

    def stall(self, duration_s: float) -> None:
        """Holds every byte of every connection (and new connections' dials) for `duration_s` from now; nothing is
        lost, all of it passes, in order, when the stall ends. Call on the proxy's loop (`ProxyThread.stall`)."""
        self.faults.stall(self._now_s(), duration_s)
        self.stats.faults += 1
        logger.info(f"wan.stall(port={self.port}, duration_s={duration_s:g})")

    def drop(self, duration_s: float) -> None:
        """Resets every open connection now and leaves new ones unanswered for `duration_s` (a link down long enough
        for middleboxes to forget its connections)."""
        self.faults.stall(self._now_s(), duration_s)
        self.stats.faults += 1
        for writers in list(self._writers.values()):
            for writer in writers:
                writer.transport.abort()  # RST, not FIN: the peers see the connection fail
            self.stats.resets += 1
        logger.info(f"wan.drop(port={self.port}, duration_s={duration_s:g}, reset={len(self._writers)})")

    def partition(self, peer_ports: set[int] | None = None) -> None:
        """Nothing passes between the target and the peers connecting from `peer_ports` (None: every peer) until
        `heal()`: their bytes are held, their new connections never reach the target."""
        self.faults.partition(peer_ports)
        self.stats.faults += 1
        logger.info(
            f"wan.partition(port={self.port}, peer_ports={'all' if peer_ports is None else sorted(peer_ports)})"
        )

    def heal(self) -> None:
        """Ends every fault now; what was held passes on."""
        self.faults.heal()
        logger.info(f"wan.heal(port={self.port})")

    async def wait_passable(self, peer_port: int) -> None:
        """Returns once no fault holds the connection from `peer_port` (polled: faults change from other calls)."""
        while (held_s := self.faults.held_for(peer_port, self._now_s())) > 0:
            await asyncio.sleep(min(held_s, FAULT_POLL_S))

    async def start(self) -> WanProxy:
        self._server = await asyncio.start_server(
            self._accept, self.listen_host, self.listen_port, limit=self.config.chunk_bytes
        )
        self._port = int(self._server.sockets[0].getsockname()[1])
        logger.info(
            f"wan.proxy_started(listen={self.address}, target={self.target_host}:{self.target_port}, "
            f"{self.config.describe()})"
        )
        return self

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 5.0)
            logger.info(f"wan.proxy_stopped(listen={self.address}, stats={self.stats})")

    async def __aenter__(self) -> WanProxy:
        return await self.start()

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    def _accept(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        # our own task (not the one asyncio wraps this callback in), so that `close` may cancel it quietly
        task = asyncio.ensure_future(self._handle(client_reader, client_writer, next(self._ids)))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _handle(
        self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter, conn_id: int
    ) -> None:
        target_writer: asyncio.StreamWriter | None = None
        peer_port = int(client_writer.get_extra_info("peername")[1])
        self._writers[conn_id] = [client_writer]
        try:
            await self.wait_passable(peer_port)  # a dial during a drop or partition is never answered
            try:
                target_reader, connected_writer = await asyncio.wait_for(
                    asyncio.open_connection(self.target_host, self.target_port, limit=self.config.chunk_bytes),
                    self.connect_timeout_s,
                )
            except (OSError, asyncio.TimeoutError) as e:
                logger.warning(f"wan.target_unreachable(target={self.target_host}:{self.target_port}, error={e!r})")
                return
            target_writer = connected_writer
            self._writers[conn_id].append(connected_writer)
            upstream_port = int(connected_writer.get_extra_info("sockname")[1])
            self._upstream_ports.add(upstream_port)
            self.stats.connections += 1
            up = _Direction(
                self, client_reader, connected_writer, to_target=True, seed_offset=2 * conn_id, peer_port=peer_port
            )
            down = _Direction(
                self, target_reader, client_writer, to_target=False, seed_offset=2 * conn_id + 1, peer_port=peer_port
            )
            pumps = [asyncio.ensure_future(up.run()), asyncio.ensure_future(down.run())]
            try:
                # both directions end normally (each side half-closed) or one fails: then close both at once
                done, pending = await asyncio.wait(pumps, return_when=asyncio.FIRST_EXCEPTION)
                for task_done in done:
                    if task_done.exception() is not None:
                        logger.debug(f"wan.connection_reset(id={conn_id}, error={task_done.exception()!r})")
            finally:
                for pump in pumps:
                    pump.cancel()
                await asyncio.gather(*pumps, return_exceptions=True)
                self._upstream_ports.discard(upstream_port)
        finally:
            self._writers.pop(conn_id, None)
            for writer in (client_writer, target_writer):
                if writer is not None:
                    writer.close()
                    with contextlib.suppress(Exception):
                        await asyncio.wait_for(writer.wait_closed(), 1.0)
