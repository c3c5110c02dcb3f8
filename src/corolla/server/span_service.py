"""The serving part for one span: the executor's runtime thread, the RPC handler registered on a P2P instance and
the same-host unix-socket endpoint for inference streams, started and stopped together (stopping ends every
session, which frees its KV cache)."""

from __future__ import annotations

import asyncio
from typing import Any

from corolla.server.block_functions import ServingLimits
from corolla.server.executor import SpanExecutor
from corolla.server.handler import TransformerConnectionHandler
from corolla.server.local_endpoint import LocalEndpoint
from corolla.server.metrics import ServerMetrics
from corolla.server.sessions import SessionTimeouts
from corolla.utils.busy_poll import BusyPollSelector
from corolla.utils.logging import get_logger

logger = get_logger(__name__)


class SpanService:
    """The serving part for one span: the executor's runtime thread + RPC handler registered on a P2P instance."""

    def __init__(
        self,
        *,
        executor: SpanExecutor,
        limits: ServingLimits,
        timeouts: SessionTimeouts,
        compression: int = 0,
        dht_client_mode: bool = False,
        metrics: ServerMetrics | None = None,
        local_socket: bool = True,
        busy_poll: BusyPollSelector | None = None,
        busy_poll_s: float = 0.005,
    ):
        self.executor = executor
        self.limits = limits
        self.runtime = executor.runtime  # started and stopped here
        self.handler = TransformerConnectionHandler(
            limits=limits,
            executor=executor,
            timeouts=timeouts,
            compression=compression,
            dht_client_mode=dht_client_mode,
            metrics=metrics,
            busy_poll=busy_poll,
            busy_poll_s=busy_poll_s,
        )
        self.p2p: Any = None
        self.local_socket = local_socket
        self.local_endpoint: LocalEndpoint | None = None

    @property
    def healthy(self) -> bool:
        return self.runtime.is_running

    async def start(self, p2p: Any) -> None:
        await asyncio.to_thread(self.runtime.start)
        self.p2p = p2p
        await self.handler.add_p2p_handlers(p2p)
        if self.local_socket:
            endpoint = LocalEndpoint(self.handler, p2p.peer_id)
            try:
                if await endpoint.start():
                    self.local_endpoint = endpoint
            except OSError as e:  # same-host clients fall back to p2p
                logger.warning(f"span_service.local_endpoint_failed({e!r})")

    async def stop(self, timeout_s: float = 10.0) -> None:
        """Unregisters the handlers, ends every session (freeing its cache) and stops the runtime."""
        if self.local_endpoint is not None:
            await self.local_endpoint.stop()
            self.local_endpoint = None
        if self.p2p is not None:
            try:
                await asyncio.wait_for(self.handler.remove_p2p_handlers(self.p2p), timeout_s)
            except Exception as e:
                logger.debug(f"span_service.remove_handlers_failed({e!r})")
        await self.handler.shutdown()
        await asyncio.to_thread(self.runtime.stop)
