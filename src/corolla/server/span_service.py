"""The serving part for one span: the core (the executor, its runtime thread, the one `SpanCore`) and its N >= 1
fronts (`front_service.FrontService`, all built from one `FrontSettings`): with N = 1 the one front runs in this
process and calls the core itself; with `num_handlers` N > 1, N handler processes each run one (`handler_pool`).
Started and stopped together (stopping ends every session, which frees its KV cache)."""

from __future__ import annotations

import asyncio
import functools
from dataclasses import replace
from typing import Any

from corolla.protocol import local_stream as ls
from corolla.server.core.engine_executor import EngineExecutor
from corolla.server.core.span_core import SpanCore
from corolla.server.front.connection_balance import BalanceDirectory
from corolla.server.front.direct_endpoint import DirectEndpoint
from corolla.server.front.front_service import FrontService
from corolla.server.front.front_service import main as handler_main
from corolla.server.front.front_settings import FrontSettings
from corolla.server.front.handler import TransformerConnectionHandler
from corolla.server.front.local_endpoint import LocalEndpoint
from corolla.server.handlers.handler_pool import HandlerPool
from corolla.server.metrics import ServerMetrics
from corolla.utils.busy_poll import BusyPollSelector
from corolla.utils.logging import get_logger

logger = get_logger(__name__)


class SpanService:
    """The serving part for one span: the core and its fronts (see the module docstring)."""

    def __init__(
        self,
        executor: EngineExecutor,
        settings: FrontSettings,
        *,
        metrics: ServerMetrics | None = None,
        num_handlers: int = 1,
        busy_poll: BusyPollSelector | None = None,
        busy_poll_s: float = 0.005,
    ):
        if num_handlers < 1:
            raise ValueError(f"num_handlers must be >= 1, got {num_handlers}")
        self.executor = executor
        self.runtime = executor.runtime  # started and stopped here
        self.num_handlers = num_handlers  # fronts: 1 in this process; N > 1 in N handler processes
        self.metrics = metrics if metrics is not None else ServerMetrics()  # the server's one set (every front's)
        # all session state, every front's (sessions counted here), under the settings' fair-use limits
        self.core = SpanCore(executor, settings.peer_limits, self.metrics)
        self.settings = settings
        if busy_poll is not None and num_handlers == 1:  # after a lone session's inline step, its next one is due
            self.runtime.after_inline = functools.partial(busy_poll.keep_hot, busy_poll_s)
        self.front: FrontService | None = None  # N = 1: the front of this process
        self.pool: HandlerPool | None = None  # N > 1
        self._balance: BalanceDirectory | None = None  # with a pool and a direct port

    @property
    def handler(self) -> TransformerConnectionHandler:
        """The RPC handler of this process's front (N = 1, once started)."""
        if self.front is None:
            raise RuntimeError("this span service has no front in this process (not started, or num_handlers > 1)")
        return self.front.handler

    @property
    def local_endpoint(self) -> LocalEndpoint | None:
        """This process's front's same-host socket (None: not listening, or no front here)."""
        return self.front.local_endpoint if self.front is not None else None

    @property
    def direct_endpoint(self) -> DirectEndpoint | None:
        """This process's front's direct port (None: not listening, or no front here)."""
        return self.front.direct_endpoint if self.front is not None else None

    @property
    def healthy(self) -> bool:
        return self.runtime.is_running and (self.pool is None or self.pool.healthy)

    async def start(self, p2p: Any) -> None:
        if not self.runtime.is_running:  # a bench may serve one executor with several services in turn
            await asyncio.to_thread(self.runtime.start)
        settings = replace(self.settings, peer_id=p2p.peer_id.to_base58())
        if settings.local_socket_dir is not None:  # no client may try a socket of a handler process an earlier run had
            ls.remove_sockets(settings.peer_id)
        if self.num_handlers == 1:
            self.front = FrontService(settings, self.core, self.metrics)
            await self.front.start(p2p)
            return
        if settings.direct is not None:  # one port for all processes; they place its connections by load
            settings = replace(settings, direct=settings.direct.with_free_port())
            try:
                self._balance = BalanceDirectory(self.num_handlers)
                settings = replace(settings, direct_balance_dir=str(self._balance.path))
            except OSError as e:  # no private temporary directory: the kernel's spread alone
                logger.warning(f"span_service.direct_balance_unavailable({e!r})")
        # the stream caps per server: the core lends each handler process its peers' stream bytes
        self.core.lend_streams(settings.peer_limits.with_stream_defaults(settings.limits.step_bytes))
        self.pool = HandlerPool(
            self.num_handlers, settings, handler_main, str(p2p.daemon_listen_maddr),
            core=self.core,  # one admission and one push table for all processes
            span=tuple(range(settings.limits.start_block, settings.limits.end_block)),
            max_frame_bytes=4 * settings.limits.max_stream_bytes,  # float16 on the wire may arrive as float32 here
        )  # fmt: skip
        await self.pool.start()

    async def stop(self, timeout_s: float = 10.0, *, keep_runtime: bool = False) -> None:
        """Stops the fronts, which ends every session (freeing its cache), and the runtime (unless `keep_runtime`:
        the next service of the same executor uses it)."""
        if self.pool is not None:
            await self.pool.stop()
            self.pool = None
        if self._balance is not None:
            self._balance.close()
            self._balance = None
        if self.front is not None:
            await self.front.stop(timeout_s)
        if not keep_runtime:
            await asyncio.to_thread(self.runtime.stop)
