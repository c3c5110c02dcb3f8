"""Pushes between processes of one server (`--num_handlers` > 1): `PushRouter` knows which handler process's
`DeviceChannel` holds the stream of each session id and forwards a pushed step there; `DeviceSessionRegistry` is
the device process's own registry (same-host socket sessions), which routes a push for a session it does not hold."""

from __future__ import annotations

from collections.abc import Sized
from typing import Protocol

from hivemind.proto import runtime_pb2

from corolla.server.core.executor import SpanExecutor
from corolla.server.core.sessions import SessionRegistry
from corolla.server.handlers import proxy_wire as wire
from corolla.server.metrics import ServerMetrics
from corolla.utils.logging import get_logger

logger = get_logger(__name__)


class HandlerChannel(Protocol):
    """What the router needs of one handler process's channel (`device_channel.DeviceChannel`)."""

    @property
    def sessions(self) -> Sized:
        """The sessions that process holds open."""
        ...

    @property
    def metrics(self) -> ServerMetrics | None: ...

    @property
    def executor(self) -> SpanExecutor: ...

    def send(self, kind: int, request_id: int, body: wire.Writer) -> None: ...

    def send_state(self) -> None: ...


class PushRouter:
    """Which handler process holds the stream of each session id (for pushes); the device's own registry serves
    same-host socket sessions."""

    def __init__(self, local: SessionRegistry):
        self.local = local
        self.routes: dict[str, HandlerChannel] = {}
        self.channels: list[HandlerChannel] = []

    def add(self, session_id: str, channel: HandlerChannel) -> None:
        owner = self.routes.setdefault(session_id, channel)
        if owner is not channel:
            logger.info(f"push_router.duplicate_session_id(session_id={session_id!r:.40}): first holder keeps pushes")

    def remove(self, session_id: str, channel: HandlerChannel) -> None:
        if self.routes.get(session_id) is channel:
            del self.routes[session_id]

    def forget(self, channel: HandlerChannel) -> None:
        for session_id in [s for s, c in self.routes.items() if c is channel]:
            del self.routes[session_id]
        if channel in self.channels:
            self.channels.remove(channel)

    def route(self, session_id: str, raw: bytes, sender: str | None, origin: HandlerChannel | None) -> bool:
        """Delivers a pushed step (serialized `ExpertRequest`); False if no process holds its session."""
        if self.local.holds(session_id):
            return self.local.push(session_id, runtime_pb2.ExpertRequest.FromString(raw), sender=sender)
        channel = self.routes.get(session_id)
        if channel is None or channel is origin:
            return False
        channel.send(wire.PUSH_OUT, 0, wire.Writer().text(session_id).text(sender).blob(raw))
        return True

    def broadcast_state(self) -> None:
        """Every handler process learns the cache left; the server's metrics too."""
        for channel in list(self.channels):
            channel.send_state()
        if self.channels and self.channels[0].metrics is not None:
            executor = self.channels[0].executor
            self.channels[0].metrics.set_cache(
                max(0, executor.max_size_bytes - executor.bytes_left), executor.bytes_left
            )


class DeviceSessionRegistry(SessionRegistry):
    """The device process's own sessions (same-host socket); a push for a session it does not hold (the next span
    is ours, its stream in a handler process) is routed there."""

    def __init__(self) -> None:
        super().__init__()
        self.router: PushRouter | None = None

    @property
    def num_open(self) -> int:
        """Sessions open in this process and in every handler process (drain waits for all of them)."""
        remote = sum(len(c.sessions) for c in self.router.channels) if self.router is not None else 0
        return super().num_open + remote

    def push(self, session_id: str, request: runtime_pb2.ExpertRequest, *, sender: str | None) -> bool:
        if self.holds(session_id) or self.router is None:
            return super().push(session_id, request, sender=sender)
        return self.router.route(session_id, request.SerializeToString(), sender, origin=None)
