"""Graceful drain, the lifecycle step (`drain_sessions`) run on SIGTERM or before a rebalance: the core's drain started
(`span_core.DrainState`: every front then refuses new sessions and offers its sessions' KV to their clients,
`front.inference_stream.SessionHandoff`), OFFLINE announced, up to `drain_timeout_s` for open sessions to move, then
the server stops."""

from __future__ import annotations

import asyncio
import time

from corolla.protocol.records import ServerState
from corolla.server.announcer import Announcer
from corolla.server.core.span_core import CoreClient
from corolla.utils.logging import get_logger

logger = get_logger(__name__)

DRAIN_POLL_S = 0.02


async def drain_sessions(core: CoreClient, announcer: Announcer, timeout_s: float) -> None:
    """Starts the core's drain (every front refuses new sessions and offers its sessions' KV to their clients) and
    announces OFFLINE (so no client plans new sessions here) while waiting up to `timeout_s` for the sessions open
    through any front to move away; then returns, and the caller ends whatever is left."""
    started = time.monotonic()
    core.drain.start(timeout_s)
    num_open = core.num_open
    logger.info(f"drain.start(sessions={num_open}, timeout_s={timeout_s})")
    offline = asyncio.ensure_future(announcer.announce(ServerState.OFFLINE))
    while core.num_open > 0 and time.monotonic() - started < timeout_s:
        await asyncio.sleep(DRAIN_POLL_S)
    await offline
    logger.info(
        f"drain.done(sessions_at_start={num_open}, left={core.num_open}, seconds={time.monotonic() - started:.2f})"
    )
