"""The core's session seam: what every front asks of the core about sessions, in one place for all fronts of a
server. `SpanCore` holds the one admission (per-peer caps, idle eviction, then the KV cache itself) and the one table
of pushes by session id, the forward slots of each peer, and whether the server drains (`DrainState`); a front in
this process calls it directly, a handler process through its device channel
(`handlers.proxy_executor.RemoteCore` offers the same `SessionCore`). A front keeps only its own streams."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import replace
from typing import Protocol

import torch
from hivemind.proto import runtime_pb2

from corolla.server.core.admission import ForwardSlots, SessionAdmission, SessionTicket
from corolla.server.core.executor import BackwardInputs, ForwardInputs, SessionCache, SessionSpec, SpanExecutor
from corolla.server.core.refusals import Draining
from corolla.server.metrics import ServerMetrics
from corolla.utils.logging import get_logger

logger = get_logger(__name__)

# delivers a pushed step (`rpc_push`) to the stream of its session: (request, sender peer) -> accepted
PushSink = Callable[[runtime_pb2.ExpertRequest, "str | None"], bool]


class PushTable:
    """The push sinks of one process's open sessions, by session id (the core's table, and a handler process's own)."""

    def __init__(self) -> None:
        self.sinks: dict[str, PushSink] = {}

    def get(self, session_id: str) -> PushSink | None:
        return self.sinks.get(session_id)

    @contextlib.contextmanager
    def routing(self, session_id: str | None, sink: PushSink | None) -> Iterator[None]:
        """Pushes for `session_id` go to `sink` while in the block (nothing without both; ValueError: another stream
        holds that id)."""
        if session_id is None or sink is None:
            yield
            return
        if session_id in self.sinks:
            raise ValueError(f"session_id {session_id!r:.100} is already open on this server; use a fresh id")
        self.sinks[session_id] = sink
        try:
            yield
        finally:
            if self.sinks.get(session_id) is sink:
                del self.sinks[session_id]


class DrainState:
    """Whether the server drains, and until when: the core's, read by every front (a handler process's copy follows
    the device's STATE frames; `time.monotonic` is one clock for all processes of a host)."""

    def __init__(self) -> None:
        self.deadline: float | None = None  # time.monotonic() at which the drain ends open sessions
        self.on_start: list[Callable[[], None]] = []  # e.g. the handler pool tells its processes

    @property
    def draining(self) -> bool:
        return self.deadline is not None

    def start(self, timeout_s: float) -> None:
        self.deadline = time.monotonic() + max(0.0, timeout_s)
        for notify in self.on_start:
            notify()

    def check_accepting(self) -> None:
        """Raises `Draining` (counted as a refusal) when the server takes no new sessions."""
        if self.deadline is not None:
            raise Draining("this server is draining (shutting down or moving); open the session elsewhere")


class SessionCore(Protocol):
    """The one seam between a front and the core for sessions (the work itself goes through `executor`)."""

    @property
    def executor(self) -> SpanExecutor: ...

    @property
    def num_open(self) -> int:
        """Sessions open on the server, through every front."""
        ...

    @property
    def drain(self) -> DrainState: ...

    def open_session(
        self,
        peer: str,
        spec: SessionSpec,
        alloc_timeout_s: float | None,
        session_id: str | None,
        sink: PushSink | None,
        *,
        opening_tokens: int | None = None,
    ) -> contextlib.AbstractAsyncContextManager[tuple[SessionTicket, SessionCache | None]]:
        """Admits a session of `peer` and opens its cache (none for a max_length=0 probe), counted in the server's
        metrics while open; pushes for `session_id` reach `sink` from before the admission until the exit.
        ValueError if `session_id` is open already. `opening_tokens`: what its opening request brings
        (`SessionAdmission.reserve`: none, no wait in line)."""
        ...

    def push(self, session_id: str, request: runtime_pb2.ExpertRequest, *, sender: str | None) -> bool:
        """Hands a pushed step to the stream of its session, wherever it is; False if no stream holds it."""
        ...

    async def forward(
        self, peer: str, block_indices: tuple[int, ...], inputs: ForwardInputs, *, chunk_tokens: int, timeout_s: float
    ) -> torch.Tensor:
        """`executor.forward` once `peer` has one of its forward slots of the server (`max_forwards_per_peer`: its
        flood waits here, not in the runtime), within `timeout_s` from then (TimeoutError)."""
        ...

    async def backward(
        self, peer: str, block_indices: tuple[int, ...], inputs: BackwardInputs, *, timeout_s: float
    ) -> list[torch.Tensor]:
        """`executor.backward` in one of `peer`'s forward slots, as `forward`."""
        ...


class SpanCore:
    """The core's sessions of one server (see the module docstring): runs in the server's event loop."""

    def __init__(self, executor: SpanExecutor, admission: SessionAdmission, metrics: ServerMetrics | None = None):
        self.executor = executor
        self.admission = admission  # replaced by `TransformerConnectionHandler.configure_limits` before serving
        self.metrics = metrics  # sessions are counted here, once for every front
        self.pushes = PushTable()
        self.drain = DrainState()
        self.forward_slots = ForwardSlots(0)  # set with the admission (`configure_limits`)

    @property
    def num_open(self) -> int:
        return self.admission.num_open

    @contextlib.asynccontextmanager
    async def open_session(
        self,
        peer: str,
        spec: SessionSpec,
        alloc_timeout_s: float | None,
        session_id: str | None,
        sink: PushSink | None,
        *,
        opening_tokens: int | None = None,
    ) -> AsyncIterator[tuple[SessionTicket, SessionCache | None]]:
        with self.pushes.routing(session_id, sink):
            reservation = self.admission.reserve(
                peer, self.executor, spec, alloc_timeout_s, opening_tokens=opening_tokens
            )
            async with reservation as opened:
                with self.metrics.session() if self.metrics is not None else contextlib.nullcontext():
                    yield opened

    def push(self, session_id: str, request: runtime_pb2.ExpertRequest, *, sender: str | None) -> bool:
        sink = self.pushes.get(session_id)
        return sink is not None and sink(request, sender)

    async def forward(
        self, peer: str, block_indices: tuple[int, ...], inputs: ForwardInputs, *, chunk_tokens: int, timeout_s: float
    ) -> torch.Tensor:
        async with self.forward_slots.hold(peer):
            work = self.executor.forward(block_indices, replace(inputs, owner=peer), chunk_tokens=chunk_tokens)
            return await asyncio.wait_for(work, timeout_s)

    async def backward(
        self, peer: str, block_indices: tuple[int, ...], inputs: BackwardInputs, *, timeout_s: float
    ) -> list[torch.Tensor]:
        async with self.forward_slots.hold(peer):
            return await asyncio.wait_for(self.executor.backward(block_indices, replace(inputs, owner=peer)), timeout_s)
