"""The serving part for one span: the executor's runtime thread, the RPC handler registered on a P2P instance (or,
with `num_handlers` > 1, the handler processes that serve the p2p streams, `handler_pool`) and the same-host
unix-socket endpoint for inference streams (in this process, or one per handler process), started and stopped
together (stopping ends every session, which frees its KV cache)."""

from __future__ import annotations

import asyncio
import functools
from typing import Any

from corolla.protocol import local_stream as ls
from corolla.protocol.direct_stream import TicketSecret
from corolla.server.core.engine_executor import EngineExecutor
from corolla.server.core.limits import PeerLimits, SessionTimeouts
from corolla.server.core.span_core import SpanCore
from corolla.server.front.block_functions import ServingLimits
from corolla.server.front.connection_balance import BalanceDirectory
from corolla.server.front.direct_endpoint import DirectEndpoint, DirectListen
from corolla.server.front.handler import TransformerConnectionHandler
from corolla.server.front.local_endpoint import LocalEndpoint
from corolla.server.handlers.handler_pool import HandlerPool
from corolla.server.handlers.handler_process import main as handler_main
from corolla.server.handlers.handler_settings import HandlerSettings
from corolla.server.metrics import ServerMetrics
from corolla.utils.busy_poll import BusyPollSelector
from corolla.utils.logging import get_logger

logger = get_logger(__name__)


class SpanService:
    """The serving part for one span: the executor's runtime thread + RPC handler registered on a P2P instance."""

    def __init__(
        self,
        *,
        executor: EngineExecutor,
        limits: ServingLimits,
        timeouts: SessionTimeouts,
        compression: int = 0,
        dht_client_mode: bool = False,
        metrics: ServerMetrics | None = None,
        local_socket: bool = True,
        busy_poll: BusyPollSelector | None = None,
        busy_poll_s: float = 0.005,
        num_handlers: int = 1,
        swarm_key_file: str | None = None,
        direct: DirectListen | None = None,
        handler_poll_s: float = 0.0,
    ):
        if num_handlers < 1:
            raise ValueError(f"num_handlers must be >= 1, got {num_handlers}")
        self.executor = executor
        self.limits = limits
        self.timeouts = timeouts
        self.runtime = executor.runtime  # started and stopped here
        self.num_handlers = num_handlers  # 1: this process serves the streams; N > 1: N handler processes do
        self.swarm_key_file = swarm_key_file
        self.handler_poll_s = handler_poll_s  # handler processes poll this long after each message (`HandlerSettings`)
        metrics = metrics if metrics is not None else ServerMetrics()  # the server's one set (its handler processes')
        # all session state, every front's (sessions counted here)
        self.core = SpanCore(executor, metrics=metrics)
        self.handler = TransformerConnectionHandler(
            limits=limits,
            core=self.core,
            timeouts=timeouts,
            compression=compression,
            dht_client_mode=dht_client_mode,
            metrics=metrics,
        )
        if busy_poll is not None and num_handlers == 1:  # after a lone session's inline step, its next one is due
            self.runtime.after_inline = functools.partial(busy_poll.keep_hot, busy_poll_s)
        self.p2p: Any = None
        self.local_socket = local_socket
        self.local_endpoint: LocalEndpoint | None = None
        self.direct = direct  # corolla clients' direct TCP port (off: None)
        self.direct_endpoint: DirectEndpoint | None = None
        self._direct_secret = TicketSecret()  # every handler process checks the tickets any of them issued
        self.pool: HandlerPool | None = None
        self._balance: BalanceDirectory | None = None  # with a pool and a direct port

    def configure_limits(self, peer_limits: PeerLimits) -> None:
        """Sets the fair-use limits (before serving): the core's (sessions, KV cache and forwards per peer, for every
        front) and this process's front's (stream bytes; a handler process's get them with its settings)."""
        self.core.configure(peer_limits)
        self.handler.configure_limits(peer_limits)

    @property
    def healthy(self) -> bool:
        return self.runtime.is_running and (self.pool is None or self.pool.healthy)

    async def start(self, p2p: Any) -> None:
        if not self.runtime.is_running:  # a bench may serve one executor with several services in turn
            await asyncio.to_thread(self.runtime.start)
        self.p2p = p2p
        if self.local_socket:  # no client may try a socket of a handler process an earlier run had
            ls.remove_sockets(p2p.peer_id.to_base58())
        if self.num_handlers == 1:
            await self.handler.add_p2p_handlers(p2p)
        else:
            await self._start_pool(p2p)  # each handler process serves its own same-host socket
        if self.local_socket and self.num_handlers == 1:
            endpoint = LocalEndpoint(self.handler, p2p.peer_id)
            try:
                if await endpoint.start():
                    self.local_endpoint = endpoint
            except OSError as e:  # same-host clients fall back to p2p
                logger.warning(f"span_service.local_endpoint_failed({e!r})")
        if self.direct is not None and self.num_handlers == 1:
            direct = DirectEndpoint(self.handler, p2p.peer_id, self.direct, self._direct_secret, reuse_port=False)
            try:
                await direct.start()
                self.direct_endpoint = direct
            except OSError as e:  # clients keep to p2p
                logger.warning(f"span_service.direct_endpoint_failed({e!r})")

    async def _start_pool(self, p2p: Any) -> None:
        handler = self.handler
        if self.direct is not None:  # the handler processes place direct-port connections by load
            try:
                self._balance = BalanceDirectory(self.num_handlers)
            except OSError as e:  # no private temporary directory: the kernel's spread alone
                logger.warning(f"span_service.direct_balance_unavailable({e!r})")
        settings = HandlerSettings(
            daemon_listen_maddr=str(p2p.daemon_listen_maddr),
            limits=self.limits,
            timeouts=self.timeouts,
            peer_limits=handler.peer_limits,
            compression=handler.compression,
            dht_client_mode=handler.dht_client_mode,
            peer_id=p2p.peer_id.to_base58(),
            swarm_key_file=self.swarm_key_file,
            kv_handoff=handler.handoff.enabled,
            local_socket_dir=str(ls.socket_dir()) if self.local_socket else None,
            direct=self.direct.with_free_port() if self.direct is not None else None,  # one port for all
            direct_secret=self._direct_secret.secret,
            direct_balance_dir=str(self._balance.path) if self._balance is not None else None,
            poll_linger_s=self.handler_poll_s,
        )
        self.pool = HandlerPool(
            self.num_handlers,
            settings,
            handler_main,
            executor=self.executor,
            core=self.core,  # one admission and one push table for all processes
            span=tuple(range(self.limits.start_block, self.limits.end_block)),
            max_frame_bytes=4 * handler.max_stream_bytes,  # float16 on the wire may arrive as float32 here
            metrics=handler.metrics,
        )
        await self.pool.start()

    async def stop(self, timeout_s: float = 10.0, *, keep_runtime: bool = False) -> None:
        """Unregisters the handlers, ends every session (freeing its cache) and stops the runtime (unless
        `keep_runtime`: the next service of the same executor uses it)."""
        if self.pool is not None:
            await self.pool.stop()
            self.pool = None
        if self._balance is not None:
            self._balance.close()
            self._balance = None
        if self.local_endpoint is not None:
            await self.local_endpoint.stop()
            self.local_endpoint = None
        if self.direct_endpoint is not None:
            await self.direct_endpoint.stop()
            self.direct_endpoint = None
        if self.p2p is not None and self.num_handlers == 1:
            try:
                await asyncio.wait_for(self.handler.remove_p2p_handlers(self.p2p), timeout_s)
            except Exception as e:
                logger.debug(f"span_service.remove_handlers_failed({e!r})")
        await self.handler.shutdown()
        if not keep_runtime:
            await asyncio.to_thread(self.runtime.stop)
