"""Which servers each generation of `corolla-api` goes through: the route log behind `/corolla/route` and the chat
page's "servers" panel. `RouteTraceMiddleware` gives every completion request a `GenerationTrace` in a context
variable, which the backend reports its session's chain to (`current_trace()`: a no-op outside a request); a trace
enters the bounded `RouteLog` only once its generation has run a step (failed, refused or unauthenticated requests
leave nothing)."""

from __future__ import annotations

import dataclasses
import threading
import time
import uuid
from collections.abc import Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from corolla.utils.lru import Lru

ROUTE_ID_HEADER = "x-corolla-route-id"
DEFAULT_ROUTE_LOG_ENTRIES = 256
MAX_PUBLIC_NAME_CHARS = 64  # server-chosen text, cut before it reaches a page
MAX_ROUTE_HOPS = 256  # hops kept per trace (a real chain is far shorter); bounds the log at ~10 MiB
TRACED_PATHS = frozenset({"/v1/chat/completions", "/v1/completions"})


@dataclass(frozen=True)
class RouteHop:
    """One server of a chain: its peer id, blocks `[start, end)`, announced name and the transport in use."""

    peer_id: str
    start: int
    end: int
    public_name: str | None
    transport: str | None


def hops_of(route: Sequence[tuple[Any, str | None]]) -> tuple[RouteHop, ...]:
    """`InferenceSession.route` (`(RemoteSpanInfo, transport)` pairs) as `RouteHop`s, the first `MAX_ROUTE_HOPS`."""
    hops = []
    for span, transport in route[:MAX_ROUTE_HOPS]:
        name = getattr(span.server_info, "public_name", None)
        name = name[:MAX_PUBLIC_NAME_CHARS] if isinstance(name, str) else None
        hops.append(RouteHop(str(span.peer_id), int(span.start), int(span.end), name, transport))
    return tuple(hops)


class GenerationTrace:
    """The route of one request's generation: hops (the latest chain), steps run, running or finished."""

    def __init__(self, log: RouteLog):
        self.id = uuid.uuid4().hex
        self._log = log
        self._lock = threading.Lock()
        self.hops: tuple[RouteHop, ...] = ()
        self.route_length = 0  # hops of the chain, including any beyond MAX_ROUTE_HOPS
        self.steps = 0
        self.route_changes = 0  # how often the chain changed after the first step (fail-over, hand-off)
        self.started_at: float | None = None
        self.finished_at: float | None = None
        self.registered = False
        self._last: list[tuple[Any, str | None]] = []  # the chain of the last step (only the backend's thread)
        self._last_length = 0

    def _same_as_last(self, route: Sequence[tuple[Any, str | None]]) -> bool:
        last = self._last
        return (
            bool(last)
            and len(route) == self._last_length
            and all(s is ls and t == lt for (s, t), (ls, lt) in zip(route, last, strict=False))
        )

    def step(self, route: Sequence[tuple[Any, str | None]]) -> None:
        """Called by the backend after each inference step with `session.route` (converted only when it changed)."""
        if self._same_as_last(route):
            with self._lock:
                self.steps += 1
                self.finished_at = None
            return
        self._last, self._last_length = list(route[:MAX_ROUTE_HOPS]), len(route)
        hops = hops_of(route)
        with self._lock:
            if self.steps > 0 and hops != self.hops:
                self.route_changes += 1
            self.hops, self.steps, self.route_length = hops, self.steps + 1, len(route)
            self.finished_at = None  # a request with n > 1 runs one session per choice, one after the other
            if self.started_at is None:
                self.started_at = time.time()
            first = not self.registered
            self.registered = True
        if first:
            self._log.add(self)

    def finish(self) -> None:
        """Called by the backend once its inference session is closed (done, failed or stopped by the client)."""
        self._last = []  # the spans themselves are not kept in the log
        with self._lock:
            if self.started_at is not None and self.finished_at is None:
                self.finished_at = time.time()

    def to_dict(self) -> dict[str, Any]:
        with self._lock:
            return {
                "id": self.id,
                "state": "finished" if self.finished_at is not None else "running",
                "steps": self.steps,
                "route_changes": self.route_changes,
                "started_at": self.started_at,
                "finished_at": self.finished_at,
                "route": [dataclasses.asdict(hop) for hop in self.hops],
                "route_truncated": self.route_length > len(self.hops),
            }


class NoTrace:
    """What `current_trace()` returns outside a traced request: records nothing."""

    def step(self, route: Sequence[tuple[Any, str | None]]) -> None:
        pass

    def finish(self) -> None:
        pass


NO_TRACE = NoTrace()
_current: ContextVar[GenerationTrace | None] = ContextVar("corolla_api_generation_trace", default=None)


def current_trace() -> GenerationTrace | NoTrace:
    """The trace of the request this generation serves, or a no-op one."""
    return _current.get() or NO_TRACE


class RouteLog(Lru[str, "GenerationTrace"]):
    """The last `max_entries` traces (oldest dropped first, reads change no order); `max_entries=0` records
    nothing."""

    def __init__(self, max_entries: int = DEFAULT_ROUTE_LOG_ENTRIES):
        if max_entries < 0:
            raise ValueError(f"route_log_entries must be >= 0, got {max_entries}")
        super().__init__(max_entries, reads_refresh=False)

    def add(self, trace: GenerationTrace) -> None:
        self.put(trace.id, trace)

    def latest(self, limit: int) -> list[GenerationTrace]:
        """Up to `limit` traces, the most recent first."""
        return self.values()[::-1][: max(0, limit)]


class RouteTraceMiddleware:
    """Pure ASGI middleware: a trace per POST to a completion endpoint, in the context of the whole request, and
    its id in the response headers once its generation has started (pure ASGI, so the endpoint runs in this
    context: Starlette's BaseHTTPMiddleware would run it in another task)."""

    def __init__(self, app: Any, route_log: RouteLog):
        self.app, self.route_log = app, route_log

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if (
            self.route_log.max_entries == 0
            or scope["type"] != "http"
            or scope.get("method") != "POST"
            or scope.get("path") not in TRACED_PATHS
        ):
            await self.app(scope, receive, send)
            return
        trace = GenerationTrace(self.route_log)

        async def send_with_id(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start" and trace.registered:
                headers = list(message.get("headers", []))
                headers.append((ROUTE_ID_HEADER.encode(), trace.id.encode()))
                message = {**message, "headers": headers}
            await send(message)

        token = _current.set(trace)
        try:
            await self.app(scope, receive, send_with_id)
        finally:
            _current.reset(token)
