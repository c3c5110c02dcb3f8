"""The device process's side of `--num_handlers` > 1: one `DeviceChannel` per handler process serves its
requests (`proxy_wire` frames) against the real executor and the one global admission, each request in a task of
its own so that the runtime merges the steps of all processes' sessions into one batched forward; `PushRouter`
sends a pushed step to whichever process holds its session's stream. Steps arrive one frame per handler loop
iteration (STEP_BATCH) and their replies leave together: every step reply that became ready in one loop iteration
(one merged forward resolves all of its steps in one callback) goes out in one REPLY_BATCH frame with the state
once.

The handler process validated every input (`block_functions`) before it sent it; this side re-checks only what a
frame could get wrong by itself (sizes, handles, block ranges inside the span)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from hivemind.proto import runtime_pb2

from corolla.server import proxy_wire as wire
from corolla.server.admission import SessionAdmission, SessionTicket
from corolla.server.executor import (
    BackwardInputs,
    ForwardInputs,
    SessionCache,
    SessionSpec,
    SpanExecutor,
    StepInputs,
)
from corolla.server.metrics import ServerMetrics
from corolla.server.proxy_executor import DeviceInfo
from corolla.server.sessions import SessionRegistry
from corolla.utils.logging import get_logger

logger = get_logger(__name__)


def device_info(executor: SpanExecutor, span: tuple[int, ...], handler_index: int, max_frame_bytes: int) -> DeviceInfo:
    """The HELLO a handler process gets: enough to size sessions and caches without asking."""
    from corolla.server.fast_executor import FastExecutor

    page_tokens, page_row_bytes = 1, 0
    if isinstance(executor, FastExecutor):  # sessions reserve whole pages of the engine's pool
        page_tokens, page_row_bytes = executor.engine.pool.page_size_tokens, executor.bytes_per_page
    return DeviceInfo(
        path=executor.path,
        handler_index=handler_index,
        max_frame_bytes=max_frame_bytes,
        block_bytes_per_token={i: executor.cache_bytes_per_token((i,)) for i in span},
        page_tokens=page_tokens,
        page_row_bytes=page_row_bytes,
    )


@dataclass(eq=False)
class _Held:
    """One session opened by a handler process, held open by its own task until CLOSE or the channel ends."""

    spec: SessionSpec
    close: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task[None] | None = None
    ticket: SessionTicket | None = None
    cache: SessionCache | None = None


class PushRouter:
    """Which handler process holds the stream of each session id (for pushes); the device's own registry serves
    same-host socket sessions."""

    def __init__(self, local: SessionRegistry):
        self.local = local
        self.routes: dict[str, DeviceChannel] = {}
        self.channels: list[DeviceChannel] = []

    def add(self, session_id: str, channel: DeviceChannel) -> None:
        owner = self.routes.setdefault(session_id, channel)
        if owner is not channel:
            logger.info(f"push_router.duplicate_session_id(session_id={session_id!r:.40}): first holder keeps pushes")

    def remove(self, session_id: str, channel: DeviceChannel) -> None:
        if self.routes.get(session_id) is channel:
            del self.routes[session_id]

    def forget(self, channel: DeviceChannel) -> None:
        for session_id in [s for s, c in self.routes.items() if c is channel]:
            del self.routes[session_id]
        if channel in self.channels:
            self.channels.remove(channel)

    def route(self, session_id: str, raw: bytes, sender: str | None, origin: DeviceChannel | None) -> bool:
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


class DeviceChannel:
    """Serves one handler process (see the module docstring)."""

    def __init__(
        self,
        index: int,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        *,
        executor: SpanExecutor,
        admission: SessionAdmission,
        router: PushRouter,
        span: tuple[int, ...],
        max_frame_bytes: int,
        metrics: ServerMetrics | None = None,
        check_accepting: Callable[[], None] | None = None,
    ):
        self.index, self.reader, self.writer = index, reader, writer
        self.executor, self.admission, self.router, self.span = executor, admission, router, span
        self.max_frame_bytes = max_frame_bytes
        self.metrics = metrics  # the server's one set: handler processes report sessions and refusals here
        self.check_accepting = check_accepting  # raises Draining while the server drains
        self.ready = asyncio.Event()  # the handler process registered its handlers
        self.pid = 0
        self.listen_maddr = ""  # the handler process's p2pd client socket (its streams arrive there)
        self.stream_names: list[str] = []
        self.sessions: dict[int, _Held] = {}
        self._handles = iter(range(1, 1 << 32))
        self._tasks: set[asyncio.Task[None]] = set()
        self._outbox: list[tuple[int, int, wire.Writer]] = []  # step replies of this loop iteration
        self._flush_scheduled = False
        self.num_requests = 0
        self.num_frames_in = 0
        self.num_frames_out = 0
        self.num_sessions_opened = 0

    # ---- output

    def _state(self) -> wire.Writer:
        executor = self.executor
        return wire.Writer().u64(max(0, executor.bytes_left)).u64(executor.bytes_waiting).u64(executor.max_size_bytes)

    def send(self, kind: int, request_id: int, body: wire.Writer) -> None:
        if not self.writer.is_closing():
            self.writer.write(body.frame(kind, request_id))
            self.num_frames_out += 1

    def _queue_reply(self, kind: int, request_id: int, body: wire.Writer) -> None:
        self._outbox.append((kind, request_id, body))
        if not self._flush_scheduled:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        items, self._outbox, self._flush_scheduled = self._outbox, [], False
        if self.writer.is_closing():
            return
        for frame in wire.batch_frames(items, wire.REPLY_BATCH, self.max_frame_bytes, head=self._state()):
            self.writer.write(frame)
            self.num_frames_out += 1

    def send_state(self) -> None:
        self.send(wire.STATE, 0, self._state())

    def _reply(self, kind: int, request_id: int, body: wire.Writer) -> None:
        state = self._state()
        state.parts.extend(body.parts)
        self.send(kind, request_id, state)

    # ---- input

    async def serve(self) -> None:
        """Serves until the handler process closes the channel or dies; then ends all of its sessions."""
        info = device_info(self.executor, self.span, self.index, self.max_frame_bytes)
        self.send(wire.HELLO, 0, _raw(info.to_json()))
        self.send_state()
        self.router.channels.append(self)
        try:
            while True:
                kind, request_id, payload = await wire.read_frame(self.reader, self.max_frame_bytes)
                self.num_frames_in += 1
                if kind == wire.STEP_BATCH:
                    for item_kind, item_id, item in wire.split_batch(wire.Reader(payload), wire.STEP_BATCH):
                        self.num_requests += 1
                        self._start(item_kind, item_id, item)
                    continue
                self.num_requests += 1
                if kind == wire.PUSH_IN:
                    fields = wire.Reader(payload)
                    session_id, sender, raw = fields.text(), fields.text(), fields.blob()
                    self.router.route(session_id, raw, sender or None, origin=self)
                elif kind == wire.METRICS:
                    self._count(wire.Reader(payload))
                elif kind == wire.READY:
                    fields = wire.Reader(payload)
                    self.pid, self.listen_maddr = fields.u32(), fields.text()
                    self.stream_names = [fields.text() for _ in range(fields.u8())]
                    self.ready.set()
                elif kind in (wire.ROUTE_ADD, wire.ROUTE_DEL):
                    session_id = wire.Reader(payload).text()
                    (self.router.add if kind == wire.ROUTE_ADD else self.router.remove)(session_id, self)
                else:
                    self._start(kind, request_id, payload)
        except wire.ChannelClosed:
            logger.info(f"device_channel.closed(handler={self.index}, sessions={len(self.sessions)})")
        finally:
            self.router.forget(self)
            await self._end_all()

    def _start(self, kind: int, request_id: int, payload: bytes | memoryview) -> None:
        task = asyncio.create_task(self._answer(kind, request_id, payload))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _count(self, fields: wire.Reader) -> None:
        from corolla.server.handler_process import METRIC_REJECTED, METRIC_SESSION_CLOSED, METRIC_SESSION_OPENED

        event, label = fields.u8(), fields.text()
        if self.metrics is None:
            return
        if event == METRIC_SESSION_OPENED:
            self.metrics.session_opened()
        elif event == METRIC_SESSION_CLOSED:
            self.metrics.session_closed()
        elif event == METRIC_REJECTED:
            self.metrics.rejected(label)

    async def _end_all(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        for held in list(self.sessions.values()):
            held.close.set()
        holders = [h.task for h in self.sessions.values() if h.task is not None]
        if holders:
            await asyncio.wait(holders, timeout=10.0)
        self.sessions.clear()
        self.router.broadcast_state()
        with contextlib.suppress(Exception):
            self.writer.close()

    async def _answer(self, kind: int, request_id: int, payload: bytes | memoryview) -> None:
        try:
            fields = wire.Reader(payload)
            if kind == wire.STEP:
                body = await self._step(fields)
            elif kind == wire.OPEN:
                body = await self._open(fields)
            elif kind == wire.CLOSE:
                body = await self._close(fields)
            elif kind == wire.FORWARD:
                body = await self._forward(fields)
            elif kind == wire.BACKWARD:
                body = await self._backward(fields)
            else:
                raise wire.FrameError(f"frame kind {kind} is not a request")
        except Exception as e:
            if kind == wire.STEP:
                self._queue_reply(wire.REPLY_ERROR, request_id, wire.encode_error(e))
            else:
                self._reply(wire.REPLY_ERROR, request_id, wire.encode_error(e))
            return
        if kind == wire.STEP:  # with the other steps that finished in this loop iteration
            self._queue_reply(wire.REPLY_TENSORS, request_id, body)
            return
        self._reply(wire.REPLY_CLOSED if kind == wire.CLOSE else
                    wire.REPLY_OPEN if kind == wire.OPEN else wire.REPLY_TENSORS, request_id, body)  # fmt: skip

    def _blocks(self, start: int, end: int) -> tuple[int, ...]:
        blocks = tuple(range(start, end))
        if not blocks or blocks[0] < self.span[0] or blocks[-1] > self.span[-1]:
            raise wire.FrameError(f"blocks {start}:{end} are not inside the span {self.span[0]}:{self.span[-1] + 1}")
        return blocks

    async def _open(self, fields: wire.Reader) -> wire.Writer:
        blocks = self._blocks(fields.u32(), fields.u32())
        spec = SessionSpec(blocks, fields.u32(), fields.u32())
        alloc_timeout_s, admit, peer, _session_id = fields.f64(), fields.u8(), fields.text(), fields.text()
        fields.done()
        if admit and self.check_accepting is not None:
            self.check_accepting()  # Draining: no new sessions
        held = _Held(spec)
        opened: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        handle = next(self._handles)
        held.task = asyncio.create_task(self._hold(handle, held, peer if admit else None, alloc_timeout_s, opened))
        await opened  # raises the admission's or the allocation's refusal
        self.sessions[handle] = held
        self.num_sessions_opened += 1
        self.router.broadcast_state()
        return wire.Writer().u32(handle).u8(held.cache is not None)

    async def _hold(
        self, handle: int, held: _Held, peer: str | None, alloc_timeout_s: float | None, opened: asyncio.Future[None]
    ) -> None:
        try:
            if peer is None:  # the executor alone (the contract suite); the handler process always admits
                async with self.executor.open_session(held.spec, alloc_timeout_s) as cache:
                    held.cache = cache
                    opened.set_result(None)
                    await held.close.wait()
                return
            async with self.admission.reserve(peer, self.executor, held.spec, alloc_timeout_s) as (ticket, cache):
                held.ticket, held.cache = ticket, cache
                opened.set_result(None)
                evicted = asyncio.ensure_future(ticket.evicted.wait())
                closing = asyncio.ensure_future(held.close.wait())
                try:
                    await asyncio.wait({evicted, closing}, return_when=asyncio.FIRST_COMPLETED)
                    if not closing.done() and ticket.eviction is not None:  # the stream's process ends the session
                        self.send(wire.EVICT, handle, wire.Writer().text(str(ticket.eviction)))
                        await closing
                finally:
                    evicted.cancel()
                    closing.cancel()
        except BaseException as e:
            if not opened.done():
                opened.set_exception(e if isinstance(e, Exception) else RuntimeError("session open was cancelled"))
            if not isinstance(e, Exception):
                raise

    async def _close(self, fields: wire.Reader) -> wire.Writer:
        held = self.sessions.pop(fields.u32(), None)
        fields.done()
        if held is not None:
            held.close.set()
            if held.task is not None:
                await asyncio.wait({held.task}, timeout=10.0)
            self.router.broadcast_state()
        return wire.Writer()

    def _held(self, handle: int) -> _Held:
        held = self.sessions.get(handle)
        if held is None or held.cache is None:
            raise wire.FrameError(f"no open session with a cache under handle {handle}")
        return held

    async def _step(self, fields: wire.Reader) -> wire.Writer:
        held = self._held(fields.u32())
        prefix_length, lone, adapter = fields.u32(), bool(fields.u8()), fields.text()
        hidden, prompts, hypo_ids = fields.tensor(), fields.tensor(), fields.tensor()
        fields.done()
        if hidden is None or hidden.dim() != 3:
            raise wire.FrameError("a step needs hidden states [B, T, H]")
        lone = lone and self.admission.num_open <= 1  # alone in this process and in all of them
        inputs = StepInputs(hidden, prefix_length, prompts, hypo_ids, adapter, lone_session=lone)
        assert held.cache is not None
        output = await self.executor.step(held.cache, inputs)  # [B, T, H]
        if held.ticket is not None:
            held.ticket.touch(hidden.shape[0] * hidden.shape[1])
        return wire.Writer().u8(1).tensor(output)

    async def _forward(self, fields: wire.Reader) -> wire.Writer:
        blocks = self._blocks(fields.u32(), fields.u32())
        chunk_tokens, adapter, hidden, prompts = fields.u32(), fields.text(), fields.tensor(), fields.tensor()
        fields.done()
        if hidden is None:
            raise wire.FrameError("a forward needs hidden states")
        output = await self.executor.forward(blocks, ForwardInputs(hidden, prompts, adapter), chunk_tokens=chunk_tokens)
        return wire.Writer().u8(1).tensor(output)

    async def _backward(self, fields: wire.Reader) -> wire.Writer:
        blocks = self._blocks(fields.u32(), fields.u32())
        adapter, hidden, grads, prompts = fields.text(), fields.tensor(), fields.tensor(), fields.tensor()
        fields.done()
        if hidden is None or grads is None:
            raise wire.FrameError("a backward needs hidden states and output gradients")
        outputs: list[torch.Tensor] = await self.executor.backward(
            blocks, BackwardInputs(hidden, grads, prompts, adapter)
        )
        body = wire.Writer().u8(len(outputs))
        for tensor in outputs:
            body.tensor(tensor)
        return body


def _raw(data: bytes) -> wire.Writer:
    body = wire.Writer()
    body.parts.append(data)
    return body
