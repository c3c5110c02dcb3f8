"""The one seam between a front and the core: `CoreClient`, everything a front asks of the core, and `SpanCore`, the
core itself (one per span service): the admission, the push table, forward slots, KV imports in flight, stream loans,
the drain and the executor. A front in the core's process calls it directly; a handler process's front calls
`RemoteCore`, the same seam over the channel."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import replace
from typing import Protocol

import torch
from hivemind.proto import runtime_pb2

from corolla.models.block_base import TensorDescriptor
from corolla.protocol.prefix import PrefixKeys
from corolla.server.core.admission import ForwardSlots, SessionAdmission, SessionTicket
from corolla.server.core.engine_executor import EngineExecutor
from corolla.server.core.executor import (
    BackwardInputs,
    ForwardInputs,
    SessionCache,
    SessionOpen,
    SessionSpec,
    StepInputs,
)
from corolla.server.core.limits import PeerLimits
from corolla.server.core.peer_bytes import StreamLoans, import_budget
from corolla.server.core.refusals import Draining
from corolla.server.metrics import ServerMetrics
from corolla.utils.logging import get_logger
from corolla.utils.tensor_bytes import TensorBytes

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


class CoreClient(Protocol):
    """The one seam between a front and the core (see the module docstring). Coroutines run in the front's event
    loop; a failing call fails its caller only. Everything a front passes was validated by its decoder
    (`front.block_functions`) where it entered; typed refusals (`refusals`, `limits`) come back as they are."""

    @property
    def path(self) -> str:
        """How the engine runs the span: `executor.PATH_FUSED` or `PATH_EAGER` (metrics, `rpc_info`, logs)."""
        ...

    @property
    def drain(self) -> DrainState: ...

    @property
    def bytes_left(self) -> int:
        """KV cache bytes neither taken nor promised (`rpc_info`'s `cache_tokens_available`, metrics)."""
        ...

    @property
    def max_size_bytes(self) -> int: ...

    def cache_bytes_per_token(self, block_indices: tuple[int, ...]) -> int: ...

    def open_session(
        self, opening: SessionOpen, sink: PushSink | None = None
    ) -> contextlib.AbstractAsyncContextManager[tuple[SessionTicket, SessionCache | None]]:
        """`SessionAdmission.reserve`, counted in the server's metrics while open; pushes for its `session_id` reach
        `sink` from before the admission until the exit. ValueError if that session id is open already."""
        ...

    def step(
        self, cache: SessionCache, inputs: StepInputs, then: Callable[[asyncio.Future], None] | None = None
    ) -> asyncio.Future[torch.Tensor | TensorBytes]:
        """One inference step of an open session: [B, T, H] -> [B, T, H] (or its bytes, `TensorBytes`), its future;
        `then(future)` (the front's reply) runs in the loop once it is done, unless it comes back done (a lone step
        run inline); a future the caller cancelled may skip it."""
        ...

    def push(self, session_id: str, request: runtime_pb2.ExpertRequest, *, sender: str | None) -> bool:
        """Hands a pushed step to the stream of its session, wherever it is; False if none holds it (as the core
        knows at once)."""
        ...

    async def forward(
        self, peer: str, block_indices: tuple[int, ...], inputs: ForwardInputs, *, chunk_tokens: int, timeout_s: float
    ) -> torch.Tensor:
        """The blocks' forward once `peer` has one of its forward slots of the server (`max_forwards_per_peer`: its
        flood waits here, not in the runtime), within `timeout_s` from then (TimeoutError)."""
        ...

    async def backward(
        self, peer: str, block_indices: tuple[int, ...], inputs: BackwardInputs, *, timeout_s: float
    ) -> list[torch.Tensor]:
        """The blocks' backward in one of `peer`'s forward slots, as `forward`."""
        ...

    async def attach_prefix(self, cache: SessionCache, namespace: str, keys: PrefixKeys) -> int:
        """`EngineExecutor.attach_prefix` for an open session: the positions its fresh cache reuses."""
        ...

    def add_prefix_keys(self, cache: SessionCache, namespace: str, keys: PrefixKeys) -> None:
        """`EngineExecutor.add_prefix_keys`: its pages are published once computed."""
        ...

    def handoff_layout(self, spec: SessionSpec) -> list[list[TensorDescriptor]]:
        """`EngineExecutor.handoff_layout` (HandoffUnsupported: the client replays)."""
        ...

    async def read_kv(self, cache: SessionCache, position: int) -> list[torch.Tensor]: ...

    async def write_kv(self, cache: SessionCache, tensors: list[torch.Tensor], position: int) -> None: ...

    def hold_import(self, peer: str, nbytes: int) -> contextlib.AbstractAsyncContextManager[None]:
        """`nbytes` of a KV import of `peer` counted as in flight on the server while in the block (`import_budget`:
        per peer and in all, every front's); `PeerLimitExceeded` / `ServerLimitExceeded` on entry, nothing taken."""
        ...


class SpanCore:
    """The core of one span service (see the module docstring), a `CoreClient` for the fronts of its own process:
    runs in the server's event loop."""

    def __init__(
        self, executor: EngineExecutor, peer_limits: PeerLimits | None = None, metrics: ServerMetrics | None = None
    ):
        self.executor = executor
        self.metrics = metrics  # sessions are counted here, once for every front
        self.pushes = PushTable()
        self.drain = DrainState()
        self.configure(peer_limits if peer_limits is not None else PeerLimits())
        # what the core passes through is the executor's own, bound once (no call of the core's per step)
        self.path, self.step, self.cache_bytes_per_token = executor.path, executor.step, executor.cache_bytes_per_token
        self.attach_prefix, self.add_prefix_keys = executor.attach_prefix, executor.add_prefix_keys
        self.handoff_layout, self.read_kv, self.write_kv = executor.handoff_layout, executor.read_kv, executor.write_kv

    def configure(self, peer_limits: PeerLimits) -> None:
        """Sets the fair-use limits of every front's sessions and forwards (before serving)."""
        self.admission = SessionAdmission(peer_limits, self.executor)
        self.forward_slots = ForwardSlots(peer_limits.max_forwards_per_peer)  # every front's, per peer
        self.imports = import_budget(peer_limits)  # every front's KV imports in flight, per peer and in all
        # with handler processes, the stream bytes lent to them (`lend_streams`); None: the one front counts its own
        self.stream_loans: StreamLoans | None = None

    def lend_streams(self, stream_limits: PeerLimits) -> None:
        """With handler processes: lends them their stream bytes under `stream_limits`' caps (with their stream
        defaults set, as every front's), so that the caps hold per server (`stream_loans`)."""
        self.stream_loans = StreamLoans(stream_limits)

    @property
    def num_open(self) -> int:
        """Sessions open on the server, through every front."""
        return self.admission.num_open

    @property
    def bytes_left(self) -> int:
        return self.executor.bytes_left

    @property
    def max_size_bytes(self) -> int:
        return self.executor.max_size_bytes

    @contextlib.asynccontextmanager
    async def open_session(
        self, opening: SessionOpen, sink: PushSink | None = None
    ) -> AsyncIterator[tuple[SessionTicket, SessionCache | None]]:
        try:
            with self.pushes.routing(opening.session_id, sink):
                async with self.admission.reserve(self.executor, opening) as opened:
                    self.report_cache()
                    with self.metrics.session() if self.metrics is not None else contextlib.nullcontext():
                        yield opened
        finally:
            self.report_cache()

    def report_cache(self) -> None:
        """The KV cache's figures to the server's metrics, once a session's cache opened or closed (any front's)."""
        if self.metrics is not None:
            left = self.executor.bytes_left
            self.metrics.set_cache(max(0, self.executor.max_size_bytes - left), left)
            stats = self.executor.prefix_cache_stats()
            self.metrics.set_prefix_cache(stats.cached_bytes, stats.evictions, stats.limit_bytes)

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

    @contextlib.asynccontextmanager
    async def hold_import(self, peer: str, nbytes: int) -> AsyncIterator[None]:
        with self.imports.hold(peer, nbytes):
            yield
