"""A handler process's way to the core (`--num_handlers` > 1): `RemoteCore`, the front-to-core seam
(`span_core.CoreClient`) over the process's channel to the device process (`protocol.channel_frames`). Every call but a
step is one CALL of the core's method by name (`DeviceLink.request`; what it may call: `DeviceChannel.calls`), one-way
ones a NOTE. This process keeps only its own streams: their push sinks and tickets; the core's figures come with every
reply and whenever any process opens or closes a session."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import socket
from collections.abc import AsyncIterator, Callable
from typing import Any

import torch
from hivemind.proto import runtime_pb2

from corolla.models.block_base import TensorDescriptor
from corolla.protocol import channel_frames as wire
from corolla.protocol.prefix import PrefixKeys
from corolla.server.core import kv_handoff as kv
from corolla.server.core.admission import SessionTicket
from corolla.server.core.executor import (
    BackwardInputs,
    ForwardInputs,
    HandoffUnsupported,
    SessionCache,
    SessionOpen,
    SessionSpec,
    StepInputs,
)
from corolla.server.core.refusals import decode_error
from corolla.server.core.span_core import DrainState, PushSink, PushTable
from corolla.utils.logging import get_logger
from corolla.utils.tensor_bytes import TensorBytes

logger = get_logger(__name__)


class RemoteSessionCache(SessionCache):
    """A session whose cache lives in the device process under `handle`."""

    def __init__(self, spec: SessionSpec, link: DeviceLink, handle: int):
        super().__init__(spec)
        self.link = link
        self.handle = handle


LINK_READ_LIMIT_BYTES = 4 << 20  # the link's stream reader pauses reading past twice this (`DeviceLink.open`)


class DeviceLink:
    """One handler process's channel to the device process: requests with ids, replies matched to them, and the
    frames the device sends on its own (state, evictions, routed pushes)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, info: wire.DeviceInfo):
        self.reader, self.writer, self.info = reader, writer, info
        self.bytes_left = 0
        self.max_size_bytes = 0
        self.drain = DrainState()  # the device core's, as its STATE frames tell it
        self.tickets: dict[int, SessionTicket] = {}  # this process's sessions by handle (an eviction ends one)
        # what the device tells on its own, and the types of its arguments (a "push": `RemoteCore` takes them)
        self.notes: dict[str, tuple[Any, Callable[..., None]]] = {
            "evict": (tuple[int, str], self._evicted),
            "ping": (tuple[int], self._pinged),
        }
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future[tuple[int, wire.Reader]]] = {}  # the reply after the device's state
        self._outbox: list[tuple[int, int, wire.Writer]] = []  # steps of this loop iteration (one STEP_BATCH)
        self._flush_scheduled = False
        self._reading: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.closed = asyncio.Event()

    @classmethod
    async def open(cls, sock: socket.socket) -> DeviceLink:
        """`connect` over the handler process's end of its channel (the peer is this server's device process). The
        reader holds up to `LINK_READ_LIMIT_BYTES` before it pauses: a merged forward's REPLY_BATCH for many sessions
        would otherwise pause and resume the socket's reading on every batch (asyncio's default is 128 KiB)."""
        reader, writer = await asyncio.open_unix_connection(sock=sock, limit=LINK_READ_LIMIT_BYTES)
        return await cls.connect(reader, writer)

    @classmethod
    async def connect(
        cls, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, max_hello_bytes: int = 1 << 20
    ) -> DeviceLink:
        """Reads the device's HELLO and first STATE, then starts reading its replies."""
        kind, _, payload = await wire.read_frame(reader, max_hello_bytes)
        if kind != wire.HELLO:
            raise wire.FrameError(f"expected HELLO from the device process, got frame kind {kind}")
        link = cls(reader, writer, wire.DeviceInfo.from_json(payload))
        kind, _, payload = await wire.read_frame(reader, max_hello_bytes)
        if kind != wire.STATE:
            raise wire.FrameError(f"expected STATE after HELLO from the device process, got frame kind {kind}")
        link._apply_state(wire.Reader(payload))
        link._reading = asyncio.create_task(link._read_forever())
        return link

    def _apply_state(self, reader: wire.Reader) -> None:
        self.bytes_left, self.max_size_bytes = reader.u64(), reader.u64()
        self.drain.deadline = reader.f64()  # None: the server does not drain

    async def _read_forever(self) -> None:
        try:
            while True:
                kind, request_id, payload = await wire.read_frame(self.reader, self.info.max_frame_bytes)
                if kind == wire.STATE:
                    self._apply_state(wire.Reader(payload))
                elif kind == wire.NOTE:
                    wire.dispatch(self.notes, *wire.read_named(payload))  # a push routed here, an eviction
                elif kind == wire.REPLY_BATCH:  # the steps one merged forward finished: state once, then each reply
                    fields = wire.Reader(payload)
                    self._apply_state(fields)
                    for item_kind, item_id, item in wire.split_batch(fields, wire.REPLY_BATCH):
                        self._resolve(item_id, item_kind, wire.Reader(item))
                else:
                    fields = wire.Reader(payload)
                    self._apply_state(fields)
                    self._resolve(request_id, kind, fields)
        except wire.ChannelClosed:
            logger.info("remote_core.channel_closed")
        except Exception as e:  # a malformed frame from our own device process: stop serving, never guess
            logger.error(f"remote_core.channel_failed({e!r})")
        finally:
            self.closed.set()
            for future in self._pending.values():
                if not future.done():
                    future.set_exception(wire.ChannelClosed("the device process is gone"))
            self._pending.clear()

    def _evicted(self, handle: int, reason: str) -> None:
        ticket = self.tickets.get(handle)
        if ticket is not None:  # (the session ended meanwhile: nothing to end)
            ticket.evict(reason)

    def _pinged(self, ping: int) -> None:
        """The device asks whether this process reads its channel (frames of its waited unread: a "pong" says it
        read up to the ping; `device_channel.DeviceChannel._watch`)."""
        self.note("pong", ping)

    def _resolve(self, request_id: int, kind: int, reply: wire.Reader) -> None:
        future = self._pending.pop(request_id, None)
        if future is not None and not future.done():
            future.set_result((kind, reply))

    def send(self, kind: int, request_id: int, body: wire.Writer) -> None:
        if self.closed.is_set():
            raise wire.ChannelClosed("the device process is gone")
        self.writer.write(body.frame(kind, request_id))

    async def call(self, kind: int, body: wire.Writer, *, batched: bool = False) -> wire.Reader:
        """Sends a request and waits for its reply; the device's typed refusal is raised here. `batched` (steps):
        the request leaves with the others of this loop iteration in one STEP_BATCH frame."""
        request_id = next(self._ids) & 0xFFFFFFFF
        future: asyncio.Future[tuple[int, wire.Reader]] = self._running_loop().create_future()
        self._pending[request_id] = future
        try:
            if batched:
                self._enqueue(kind, request_id, body)
            else:
                self.send(kind, request_id, body)
            if self.writer.transport.get_write_buffer_size() > (1 << 20):
                await self.writer.drain()
            reply_kind, reader = await future
        finally:
            self._pending.pop(request_id, None)
        if reply_kind == wire.REPLY_ERROR:
            raise decode_error(reader)
        return reader

    async def request(self, name: str, *args: object) -> object:
        """Calls the core's `name` (`device_channel.DeviceChannel.CALLS`) and returns what it returned."""
        reply = await self.call(wire.CALL, wire.named(name, args))
        value = reply.value()
        reply.done()
        return value

    def note(self, name: str, *args: object) -> bool:
        """Tells the core `name` (nothing waits for it); False once the channel is gone."""
        try:
            self.send(wire.NOTE, 0, wire.named(name, args))
        except (wire.ChannelClosed, wire.FrameError) as e:
            logger.info(f"remote_core.note_not_sent(name={name}): {e!r}")
            return False
        return True

    def _running_loop(self) -> asyncio.AbstractEventLoop:
        """The loop this link serves, looked up once (`asyncio.get_running_loop` costs a getpid() syscall a call)."""
        loop = self._loop
        if loop is None:
            loop = self._loop = asyncio.get_running_loop()
        return loop

    def _enqueue(self, kind: int, request_id: int, body: wire.Writer) -> None:
        if self.closed.is_set():
            raise wire.ChannelClosed("the device process is gone")
        self._outbox.append((kind, request_id, body))
        if not self._flush_scheduled:
            self._flush_scheduled = True
            self._running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        """Writes the queued steps: alone as a STEP frame, together as STEP_BATCH frames within the frame bound."""
        items, self._outbox, self._flush_scheduled = self._outbox, [], False
        if self.closed.is_set() or self.writer.is_closing():
            return  # their futures fail with ChannelClosed (the reading task's end)
        for frame in wire.batch_frames(items, wire.STEP_BATCH, self.info.max_frame_bytes):
            self.writer.write(frame)

    async def close(self) -> None:
        if self._reading is not None:
            self._reading.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._reading
        self.writer.close()


class RemoteCore:
    """The device process's `SpanCore` as this process's fronts see it: the same `CoreClient` (see the module
    docstring)."""

    def __init__(self, link: DeviceLink):
        self.link = link
        self.pushes = PushTable()  # this process's sessions: where a push the core routes here goes
        self.link.notes["push"] = (tuple[str, str | None, bytes], self._deliver)
        self.link.notes["recall_stream"] = (tuple[int, str, int, int, int], self._recall_stream)
        # the front's budget (`answer_recalls`)
        self._give_back_loans: Callable[[str, int, int, int], None] | None = None
        # what the device told once (HELLO), and its drain state as its STATE frames keep it
        self.path, self.cache_bytes_per_token, self.drain = link.info.path, link.info.cache_bytes_per_token, link.drain

    @property
    def bytes_left(self) -> int:
        return self.link.bytes_left

    @property
    def max_size_bytes(self) -> int:
        return self.link.max_size_bytes

    @contextlib.asynccontextmanager
    async def open_session(
        self, opening: SessionOpen, sink: PushSink | None = None
    ) -> AsyncIterator[tuple[SessionTicket, SessionCache | None]]:
        """Admitted by the device's core ("open" carries the session id, routed here while open); yields this
        process's ticket (an "evict" note sets it) and the cache (None for a max_length=0 probe)."""
        spec, routed = opening.spec, opening.session_id if sink is not None else None
        with self.pushes.routing(routed, sink):
            blocks = (spec.block_indices[0], spec.block_indices[-1] + 1)
            opened = await self.link.request("open", blocks, spec.batch_size, spec.max_length_tokens,
                                             opening.alloc_timeout_s, opening.peer, routed, opening.opening_tokens,
                                             spec.shadow)  # fmt: skip
            handle, has_cache = _typed(opened, tuple[int, bool])
            ticket = SessionTicket(peer=opening.peer, reserved_bytes=0)  # (the core's ticket holds the figures)
            self.link.tickets[handle] = ticket
            try:
                yield ticket, (RemoteSessionCache(spec, self.link, handle) if has_cache else None)
            finally:
                ticket.released.set()
                self.link.tickets.pop(handle, None)
                with contextlib.suppress(wire.ChannelClosed):
                    await asyncio.shield(self.link.request("close", handle))

    def _own(self, cache: SessionCache) -> RemoteSessionCache:
        if not isinstance(cache, RemoteSessionCache) or cache.link is not self.link:
            raise TypeError(f"{type(cache).__name__} is not a cache of this process's link to the core")
        return cache

    def step(
        self, cache: SessionCache, inputs: StepInputs, then: Callable[[asyncio.Future], None] | None = None
    ) -> asyncio.Future[torch.Tensor | TensorBytes]:
        """`CoreClient.step` over the link (its reply's bytes): `then` is the future's done callback."""
        future = asyncio.ensure_future(self._step(cache, inputs))
        if then is not None:
            future.add_done_callback(then)
        return future

    async def _step(self, cache: SessionCache, inputs: StepInputs) -> torch.Tensor | TensorBytes:
        handle = self._own(cache).handle
        body = wire.Writer().step_head(handle, inputs.prefix_length, inputs.lone_session, inputs.adapter)
        if inputs.hidden_states is None and inputs.hidden_bytes is not None and inputs.hidden_meta is not None:
            body.record(*inputs.hidden_meta, inputs.hidden_bytes)  # the step's bytes as decoded: no tensor built
        else:
            body.tensor(inputs.tensor())
        body.tensor(inputs.prompts).tensor(inputs.hypo_ids)
        return _one_output(await self.link.call(wire.STEP, body, batched=True))

    def push(self, session_id: str, request: runtime_pb2.ExpertRequest, *, sender: str | None) -> bool:
        """To the core, which routes it to the process holding the session (this one too): True once sent."""
        return self.link.note("push", session_id, sender, request.SerializeToString())

    def _deliver(self, session_id: str, sender: str | None, raw: bytes) -> None:
        """A push the core routed here (a "push" note): its stream's guard decides."""
        sink = self.pushes.get(session_id)
        if sink is not None:
            sink(runtime_pb2.ExpertRequest.FromString(raw), sender or None)

    async def forward(
        self, peer: str, block_indices: tuple[int, ...], inputs: ForwardInputs, *, chunk_tokens: int, timeout_s: float
    ) -> torch.Tensor:
        output = await self.link.request("forward", peer, (block_indices[0], block_indices[-1] + 1), inputs.hidden_states,
                                         inputs.prompts, inputs.adapter, chunk_tokens, timeout_s)  # fmt: skip
        return _typed(output, torch.Tensor)

    async def backward(
        self, peer: str, block_indices: tuple[int, ...], inputs: BackwardInputs, *, timeout_s: float
    ) -> list[torch.Tensor]:
        outputs = await self.link.request("backward", peer, (block_indices[0], block_indices[-1] + 1),
                                          inputs.hidden_states, inputs.grad_outputs, inputs.prompts, inputs.adapter,
                                          timeout_s)  # fmt: skip
        return list(_typed(outputs, tuple[torch.Tensor, ...]))

    # prefix caching: the device process's engine holds the cache; keys recorded for publication go one way, in
    # order with the session's steps (publication is lazy: before a later step or at close)

    async def attach_prefix(self, cache: SessionCache, namespace: str, keys: PrefixKeys) -> int:
        hit = await self.link.request(
            "attach_prefix", self._own(cache).handle, namespace, keys.first_block, keys.hashes
        )
        return _typed(hit, int)

    def add_prefix_keys(self, cache: SessionCache, namespace: str, keys: PrefixKeys) -> None:
        self.link.note("add_prefix_keys", self._own(cache).handle, namespace, keys.first_block, keys.hashes)

    def handoff_layout(self, spec: SessionSpec) -> list[list[TensorDescriptor]]:
        """The device executor's layout (`DeviceInfo.handoff_shapes`) for `spec`'s batch and length."""
        info = self.link.info
        if not info.handoff_shapes:
            raise HandoffUnsupported(
                info.handoff_refused or "this server's executor can't hand off KV: the client replays"
            )
        block: list[TensorDescriptor] = []
        for shape, dtype in info.handoff_shapes:
            full = list(shape)
            full[0], full[kv.LENGTH_DIM] = spec.batch_size, spec.max_length_tokens
            block.append(TensorDescriptor(tuple(full), getattr(torch, dtype), torch.device("cpu")))
        return [list(block) for _ in spec.block_indices]

    async def read_kv(self, cache: SessionCache, position: int) -> list[torch.Tensor]:
        return list(
            _typed(await self.link.request("read_kv", self._own(cache).handle, position), tuple[torch.Tensor, ...])
        )

    async def write_kv(self, cache: SessionCache, tensors: list[torch.Tensor], position: int) -> None:
        handle = self._own(cache).handle
        kv.check_handoff_frame(tensors, self.link.info.max_frame_bytes)
        await self.link.request("write_kv", handle, position, tuple(t.contiguous() for t in tensors))

    @contextlib.asynccontextmanager
    async def hold_import(self, peer: str, nbytes: int) -> AsyncIterator[None]:
        """The core's count of imports in flight, every process's ("take_import", one call an import: the core's
        refusal is raised here), given back with a "give_import" note on exit (and by the core for whatever a
        channel still holds when it ends). A caller cancelled while the call is out gives back what it took once
        the reply comes."""
        call = asyncio.ensure_future(self.link.request("take_import", peer, nbytes))
        try:
            handle = _typed(await asyncio.shield(call), int)
        except asyncio.CancelledError:
            call.add_done_callback(self._give_back_taken)
            raise
        try:
            yield
        finally:
            self.link.note("give_import", handle)

    async def borrow_stream(self, peer: str, nbytes: int) -> None:
        """`nbytes` more of `peer`'s stream bytes lent to this process by the core ("lend_stream", one call a loan: the
        core's refusal, past the stream caps, is raised here; `core.peer_bytes.StreamLoans`)."""
        _typed(await self.link.request("lend_stream", peer, nbytes), int)

    def repay_stream(self, peer: str, nbytes: int) -> None:
        self.link.note("repay_stream", peer, nbytes)

    def answer_recalls(self, give_back: Callable[[str, int, int, int], None]) -> None:
        self._give_back_loans = give_back

    def _recall_stream(self, recall: int, peer: str, peer_bytes: int, any_bytes: int, reclaim_bytes: int) -> None:
        """The core recalls idle loans (a "recall_stream" note): the budget repays what it gives back ("repay_stream"
        notes), then "recalled" tells the core it answered (the notes arrive in order)."""
        if self._give_back_loans is not None:
            self._give_back_loans(peer, peer_bytes, any_bytes, reclaim_bytes)
        self.link.note("recalled", recall)

    def _give_back_taken(self, call: asyncio.Future[object]) -> None:
        if not call.cancelled() and call.exception() is None and isinstance(handle := call.result(), int):
            self.link.note("give_import", handle)


def _typed(value: object, kind: Any) -> Any:
    """`value` if it is of `kind` (a type, or a tuple type: `tuple[int, bool]`, `tuple[torch.Tensor, ...]`), else
    FrameError: what the device process replied is checked as what it returns."""
    if not wire.matches(value, kind):
        raise wire.FrameError(f"the device process replied {type(value).__name__} where {kind} was due")
    return value


def _one_output(reader: wire.Reader) -> TensorBytes:
    """A step's reply: one tensor [B, T, H], as a copy of its bytes with its dtype and shape (no tensor built: the
    front encodes its reply from them, `codecs.serialize_tensor_bytes`)."""
    count, record = reader.u8(), reader.record()
    reader.done()
    if count != 1 or record is None:
        raise wire.FrameError(f"expected one reply tensor, got {count}")
    dtype, shape, raw = record
    return TensorBytes(memoryview(bytearray(raw)), dtype, shape)
