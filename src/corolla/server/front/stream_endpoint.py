"""Streams served outside p2pd, for the same-host socket (`local_endpoint`) and the direct port (`direct_endpoint`):
the connections a listener serves (`Connections`), the hello every connection starts with (`read_hello`,
`check_hello`), one connection from its hello to its close (`serve_connection`, the task's own coroutine: a listener's
code runs at the hello and at the end, not on each step's way), and one `rpc_inference` stream: frames in (`protocol.local_stream` framing, each payload opened by
a `FrameCodec`), `ExpertRequest`s into the handler's own `rpc_inference` (or the `rpc_forward_stream` /
`rpc_backward_stream` of a training call: the hello names the rpc), its responses out as frames. Shared by the
same-host socket (`local_endpoint`, plain frames) and the direct TCP port (`direct_endpoint`, sealed frames).

A connection is a `FrameConnection` (an asyncio `Protocol` handing out whole frames). Every
frame's declared length is checked against `max_frame_bytes` before its payload is read; where a `StreamLease` is
given (a remote peer's stream) the payload is charged to the handler's per-peer and total stream byte budget before
it is waited for and released once the handler has taken the next message, and a started payload that stops
arriving for `idle_s` ends the stream, as on p2p (`stream_guard`)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

from google.protobuf.message import DecodeError
from hivemind.p2p import P2PContext
from hivemind.proto import runtime_pb2

from corolla.protocol import local_stream as ls
from corolla.server.core.limits import StreamStalled
from corolla.server.front import step_timeline
from corolla.server.front.inference_stream import StepOrder, StepPort
from corolla.server.front.stream_guard import StreamLease
from corolla.utils.logging import get_logger

logger = get_logger(__name__)

HELLO_TIMEOUT_S = 5.0  # a connection that has not said hello by then is dropped
# a training call's tensors (4-12 MiB a 512-token step of hidden 4096) through p2pd moved at ~100 MB/s on loopback:
# ~210 of a lone client's 529 ms step on an H200 (docs/decisions/0059)
SERVED_RPCS = ("rpc_inference", "rpc_forward_stream", "rpc_backward_stream")
CLOSE_WAIT_S = 10.0
LINGER_S = 2.0  # after its last frame, how long the server waits for the client to close its side


DEFAULT_LIMIT_BYTES = 1 << 16
INSIDE_A_MESSAGE = "inside a message"


class FrameConnection(asyncio.Protocol):
    """One connection of the same-host socket or the direct port as an asyncio `Protocol` that hands
    out whole frames (`protocol.local_stream` framing), in place of a `StreamReader`/`StreamWriter` pair.

    A frame is taken whole once its bytes are buffered (`take_frame`: one header parse and one slice), either by a task
    (`read_frame`: it waits once for the bytes the frame still needs, where a `StreamReader` wakes its reader per chunk
    and reads a frame in two awaited calls) or by a callback (`deliver`: told when bytes or the end of the input arrive,
    no task woken: an inference stream's steps). A declared length is checked, and charged where asked, when its header
    is parsed, before the payload is waited for. A payload that stops arriving for `idle_s` ends the stream
    (`StreamStalled`): one timer per wait, re-armed from the last byte's arrival when it fires early, not moved per
    chunk. Reading pauses while more than `2 * limit_bytes` wait unread and nothing waits for them, as a `StreamReader`
    with that limit does; writing follows the transport's flow control (`drain`, `writing_paused`, `on_writable`).

    `serve`, where given, runs as the connection's task once the transport is made (a listener's protocol
    factory)."""

    def __init__(
        self,
        limit_bytes: int = DEFAULT_LIMIT_BYTES,
        serve: Callable[[FrameConnection], Coroutine[Any, Any, None]] | None = None,
    ):
        self.transport: asyncio.Transport | None = None
        self._serve = serve
        self._limit = limit_bytes
        self._buffer = bytearray()
        self._header: tuple[int, int] | None = None  # the pending frame's (kind, length), parsed and charged
        self._want = 0  # bytes the pending `read_frame` waits for (0: none waits)
        self._waiter: asyncio.Future[None] | None = None
        self._on_data: Callable[[], None] | None = None  # `deliver`'s callback
        self.at_eof = False  # the peer's input ended (or the connection was lost)
        self.lost = False  # the connection was lost: nothing more goes out
        self._reading_paused = False
        self.writing_paused = False
        self.on_writable: Callable[[], None] | None = None  # called once when writing resumes
        self._drain_waiter: asyncio.Future[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._last_data_at = 0.0
        self._timer: asyncio.TimerHandle | None = None  # the pending wait's idle timer
        self.task: asyncio.Task[None] | None = None

    # ---- asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        self._loop = asyncio.get_running_loop()
        if self._serve is not None:
            self.task = self._loop.create_task(self._serve(self))

    def data_received(self, data: bytes) -> None:
        buffer = self._buffer
        buffer += data
        if self._on_data is not None:
            if self._timer is not None:
                assert self._loop is not None
                self._last_data_at = self._loop.time()
            self._on_data()
        elif self._want:
            assert self._loop is not None
            self._last_data_at = self._loop.time()
            if len(buffer) >= self._want:
                self._wake()
        elif len(buffer) > 2 * self._limit and not self._reading_paused and self.transport is not None:
            self._reading_paused = True
            self.transport.pause_reading()

    def eof_received(self) -> bool:
        self.at_eof = True
        self._input_ended()
        return True  # keep the transport open: the last frame (END/ERROR) still goes out

    def connection_lost(self, exc: Exception | None) -> None:
        self.at_eof = self.lost = True
        self._input_ended()
        waiter = self._drain_waiter
        if waiter is not None and not waiter.done():
            waiter.set_exception(ConnectionResetError("Connection lost"))
        self.writing_paused = False  # nothing will be written: who waits to write is told (`on_writable`)
        callback, self.on_writable = self.on_writable, None
        if callback is not None:
            callback()

    def pause_writing(self) -> None:
        self.writing_paused = True

    def resume_writing(self) -> None:
        self.writing_paused = False
        waiter = self._drain_waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)
        callback, self.on_writable = self.on_writable, None
        if callback is not None:
            callback()

    # ---- reading

    def _input_ended(self) -> None:
        self._wake()
        if self._on_data is not None:
            self._on_data()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def take_frame(
        self, max_payload_bytes: int, charge: Callable[[int], None] | None = None
    ) -> tuple[int, bytes] | None:
        """The next (kind, payload) if all its bytes are buffered, else None (its header parsed and charged once
        that much is: ValueError for an unknown kind or a payload over `max_payload_bytes`, nothing of it read).
        `charge(length)` runs for a MESSAGE frame's payload when its header is parsed."""
        buffer = self._buffer
        header = self._header
        if header is None:
            if len(buffer) < ls.HEADER_BYTES:
                return None
            header = ls.parse_header(buffer, max_payload_bytes)
            if charge is not None and header[0] == ls.MESSAGE:
                charge(header[1])
            self._header = header
        kind, length = header
        end = ls.HEADER_BYTES + length
        if len(buffer) < end:
            return None
        self._header = None
        payload = bytes(buffer[ls.HEADER_BYTES : end]) if length else b""
        del buffer[:end]
        if self._reading_paused and len(buffer) <= self._limit and self.transport is not None:
            self._reading_paused = False
            self.transport.resume_reading()
        return kind, payload

    def _needed(self) -> int:
        """The bytes the next frame needs buffered: its header, or (parsed) the whole frame."""
        return ls.HEADER_BYTES if self._header is None else ls.HEADER_BYTES + self._header[1]

    def _resume_reading(self) -> None:
        if self._reading_paused and self.transport is not None:
            self._reading_paused = False
            self.transport.resume_reading()

    def _arm_idle(self, idle_s: float, fail: Callable[[BaseException], None]) -> None:
        """`fail(StreamStalled)` once no byte came for `idle_s` (from now, then from the last byte)."""
        assert self._loop is not None
        if self._timer is None:
            self._last_data_at = self._loop.time()
            self._timer = self._loop.call_at(self._last_data_at + idle_s, self._idle_check, idle_s, fail)

    def _idle_check(self, idle_s: float, fail: Callable[[BaseException], None]) -> None:
        assert self._loop is not None
        self._timer = None
        due = self._last_data_at + idle_s
        if due <= self._loop.time():
            fail(StreamStalled(f"the peer sent nothing for stream_idle_timeout={idle_s} s {INSIDE_A_MESSAGE}"))
        else:
            self._timer = self._loop.call_at(due, self._idle_check, idle_s, fail)

    def _cancel_idle(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    async def read_frame(
        self, max_payload_bytes: int, *, charge: Callable[[int], None] | None = None, idle_s: float | None = None
    ) -> tuple[int, bytes]:
        """The next (kind, payload) (`take_frame`), waiting for its bytes: IncompleteReadError at the end of the input,
        StreamStalled after `idle_s` without a byte inside a payload (None: no limit)."""
        while (frame := self.take_frame(max_payload_bytes, charge)) is None:
            await self._wait_for(self._needed(), idle_s if self._header is not None else None)
        return frame

    async def _wait_for(self, nbytes: int, idle_s: float | None) -> None:
        """Until `nbytes` are buffered (one wake-up, when they are) or the input ends."""
        if self.at_eof:
            raise asyncio.IncompleteReadError(bytes(self._buffer), nbytes)
        loop = self._loop
        assert loop is not None
        self._resume_reading()
        waiter = self._waiter = loop.create_future()
        self._want = nbytes
        if idle_s is not None:

            def stalled(error: BaseException) -> None:
                if not waiter.done():
                    waiter.set_exception(error)

            self._arm_idle(idle_s, stalled)
        try:
            await waiter
        finally:
            self._waiter, self._want = None, 0
            self._cancel_idle()

    def deliver(
        self, on_data: Callable[[], None], *, idle_s: float | None = None, fail: Callable[[BaseException], None]
    ) -> None:
        """Calls `on_data` as bytes or the end of the input arrive, until `stop_delivery` (it takes frames itself with
        `take_frame`); `fail(StreamStalled)` where a started payload stops arriving for `idle_s`."""
        self._on_data = on_data
        self._resume_reading()
        if idle_s is not None and self._header is not None:
            self._arm_idle(idle_s, fail)

    def stop_delivery(self) -> None:
        self._on_data = None
        self._cancel_idle()

    async def discard_until_eof(self, timeout_s: float) -> None:
        """Drops what the peer still sends until it closes, for at most `timeout_s`: closing a socket with unread
        data resets the connection, and the peer could lose the last frame."""
        loop = self._loop
        assert loop is not None
        self.stop_delivery()
        deadline = loop.time() + timeout_s
        while not self.at_eof and (remaining := deadline - loop.time()) > 0:
            self._buffer.clear()
            self._header = None
            try:
                await asyncio.wait_for(self._wait_for(1, None), remaining)
            except asyncio.IncompleteReadError:
                return

    # ---- writing

    def writelines(self, buffers: list[bytes]) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.writelines(buffers)

    def write(self, data: bytes) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(data)

    async def drain(self) -> None:
        """Waits while the transport's buffer is over its high-water mark; ConnectionResetError once it is lost."""
        if self.lost:
            raise ConnectionResetError("Connection lost")
        if not self.writing_paused:
            return
        assert self._loop is not None
        waiter = self._drain_waiter = self._loop.create_future()
        try:
            await waiter
        finally:
            self._drain_waiter = None

    def write_eof(self) -> None:
        if self.transport is not None and not self.transport.is_closing() and self.transport.can_write_eof():
            self.transport.write_eof()

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


class Connections:
    """The connections one listener serves, each in its own task: counted while served (`serving`); `close` stops
    the listener and ends them (their sessions free their caches), waiting up to `CLOSE_WAIT_S`."""

    def __init__(self) -> None:
        self.server: asyncio.AbstractServer | None = None
        self._tasks: set[asyncio.Task] = set()
        self._closing = False

    @property
    def num_open(self) -> int:
        return len(self._tasks)

    @contextlib.contextmanager
    def serving(self) -> Iterator[None]:
        """Counts the current task (one connection's) as open for the block. Cancelled by `close`, the block ends
        the task quietly: asyncio (3.11) logs a traceback for a connection callback's task that ends cancelled."""
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            yield
        except asyncio.CancelledError:
            if not self._closing:
                raise
        finally:
            self._tasks.discard(task)

    async def close(self) -> None:
        self._closing = True
        if self.server is not None:
            self.server.close()
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=CLOSE_WAIT_S)
        self.server = None


async def read_hello(conn: FrameConnection) -> bytes:
    """The payload of a connection's first frame, which must be a HELLO (within `HELLO_TIMEOUT_S`: else
    `asyncio.TimeoutError`); ValueError for another kind or an oversized frame."""
    kind, payload = await asyncio.wait_for(conn.read_frame(ls.MAX_HELLO_BYTES), HELLO_TIMEOUT_S)
    if kind != ls.HELLO:
        raise ValueError(f"expected a hello frame first, got kind {kind}")
    return payload


def check_hello(what: str, *, version: int, expected_version: int, peer_id: str, own_peer_id: str, rpc: str) -> None:
    """ValueError naming what a hello got wrong: another protocol version, another server's peer id, an rpc that
    is not served (`what`: "local stream" / "direct stream", as the client's message names it)."""
    if version != expected_version:
        raise ValueError(f"{what} version {version} is not {expected_version}")
    if peer_id != own_peer_id:
        raise ValueError(f"this {what} endpoint belongs to another peer id")
    if rpc not in SERVED_RPCS:
        raise ValueError(f"rpc {rpc!r:.40} is not served here (only {', '.join(SERVED_RPCS)})")


class StreamRpcs(Protocol):
    """What a stream endpoint serves: the p2p front's own streamed rpcs (`handler.TransformerConnectionHandler`,
    `SERVED_RPCS`), so every transport shares its decoder, sessions, training batches and refusals."""

    max_stream_bytes: int  # the largest message the front takes (a frame's payload bound follows from it)

    def rpc_inference(
        self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]: ...

    async def serve_steps(
        self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext, port: StepPort
    ) -> None: ...

    def rpc_forward_stream(
        self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]: ...

    def rpc_backward_stream(
        self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]: ...


class FrameCodec(Protocol):
    """How one connection's payloads look on the wire (plain, or sealed per direction)."""

    overhead_bytes: int  # what encoding adds to a payload

    def encode(self, kind: int, payload: bytes) -> list[bytes]:
        """The whole frame (header and payload) for `payload`, as buffers for `writer.writelines`."""
        ...

    def decode(self, kind: int, payload: bytes) -> bytes:
        """The payload of a received frame; ValueError if it is not what the peer's side encoded."""
        ...


class PlainFrames:
    """The same-host socket's frames: payloads as they are."""

    overhead_bytes = 0

    def encode(self, kind: int, payload: bytes) -> list[bytes]:
        return ls.frame(kind, payload)  # the payload is not copied

    def decode(self, kind: int, payload: bytes) -> bytes:
        return payload


@dataclass(frozen=True)
class AcceptedStream:
    """What a listener's hello check grants a connection: its stream's context, framing and budget."""

    context: P2PContext
    codec: FrameCodec
    lease: StreamLease | None = None  # a remote peer's stream: its payloads charged to the handler's budget
    idle_s: float | None = None
    peer: str | None = None  # the remote peer the listener admitted (None: the same host's)


class StreamListener(Protocol):
    """A listener as `serve_connection` drives it (`local_endpoint.LocalEndpoint`, `direct_endpoint.DirectEndpoint`)."""

    @property
    def handler(self) -> StreamRpcs: ...

    @property
    def max_frame_bytes(self) -> int: ...

    @property
    def connections(self) -> Connections: ...

    async def accept(self, conn: FrameConnection) -> AcceptedStream | None:
        """The connection's hello checked and answered (ACCEPT or ERROR); None: refused."""
        ...

    def ended(self, accepted: AcceptedStream | None) -> None:
        """The connection closed (after `accept`'s grant, if any)."""
        ...


async def serve_connection(listener: StreamListener, conn: FrameConnection) -> None:
    """One connection's task: counted open while served (`Connections.serving`), its hello (`listener.accept`), then the
    stream of the rpc it named (the context's `handle_name`) to the end; the connection closed and `listener.ended`
    called whatever happens."""
    accepted: AcceptedStream | None = None
    try:
        with listener.connections.serving():
            accepted = await listener.accept(conn)
            if accepted is not None:
                await serve_inference(
                    listener.handler, conn, accepted.context, accepted.codec, listener.max_frame_bytes,
                    lease=accepted.lease, idle_s=accepted.idle_s, rpc=accepted.context.handle_name,
                )  # fmt: skip
    except (ConnectionError, asyncio.IncompleteReadError) as e:
        logger.debug(f"stream_endpoint.connection_lost({e!r})")
    finally:
        conn.close()
        listener.ended(accepted)


async def read_frame(
    conn: FrameConnection,
    codec: FrameCodec,
    max_payload_bytes: int,
    *,
    lease: StreamLease | None = None,
    idle_s: float | None = None,
) -> tuple[int, bytes, int]:
    """(kind, decoded payload, bytes charged to `lease`) of the next frame; ValueError for an unknown kind, a length
    over the limit, a payload that does not decode; IncompleteReadError at the end of the connection; StreamStalled
    for a payload that stops arriving for `idle_s`."""
    charged = 0

    def charge(length: int) -> None:
        nonlocal charged
        assert lease is not None
        lease.charge(length)  # before the payload is waited for
        charged = length

    kind, payload = await conn.read_frame(
        max_payload_bytes + codec.overhead_bytes, charge=None if lease is None else charge, idle_s=idle_s
    )
    return kind, codec.decode(kind, payload), charged


class SocketPort:
    """One accepted connection's requests and replies: `requests()` for a task (an rpc's stream, a session's opening
    and KV import), and, once an inference session runs steps, its `inference_stream.StepPort` (the client's next
    request handed over from the connection's data callback, each reply written as it is made: no task per step)."""

    def __init__(
        self, conn: FrameConnection, codec: FrameCodec, max_frame_bytes: int, *,
        lease: StreamLease | None, idle_s: float | None, timeline: step_timeline.StreamTimeline | None,
    ):  # fmt: skip
        self.conn, self.codec, self.lease, self.idle_s, self.timeline = conn, codec, lease, idle_s, timeline
        self.max_payload_bytes = max_frame_bytes + codec.overhead_bytes
        self.charged = 0  # the last message's bytes in `lease`, released once the handler takes the next
        self._charge = None if lease is None else self._charge_lease
        self.order: StepOrder | None = None
        self._handing = False  # inside `ready`
        self._again = False  # `ready` was called again meanwhile

    def _charge_lease(self, length: int) -> None:
        assert self.lease is not None
        self.lease.charge(length)  # before the payload is waited for
        self.charged = length

    def _release(self) -> None:
        if self.lease is not None and self.charged:
            self.lease.release(self.charged)  # the handler took the previous message
            self.charged = 0

    def _request(self, kind: int, payload: bytes) -> runtime_pb2.ExpertRequest | None:
        """The request a frame holds; None for END; ValueError for another kind or a payload that is no request."""
        payload = self.codec.decode(kind, payload)
        if kind == ls.END:
            return None
        if kind != ls.MESSAGE:
            raise ValueError(f"expected a request frame, got kind {kind}")
        try:
            request = runtime_pb2.ExpertRequest.FromString(payload)
        except DecodeError as e:
            raise ValueError(f"request frame is not an ExpertRequest: {e}") from None
        if self.timeline is not None:
            self.timeline.request_read()
        return request

    async def requests(self) -> AsyncIterator[runtime_pb2.ExpertRequest]:
        while True:
            self._release()
            try:
                kind, payload = await self.conn.read_frame(
                    self.max_payload_bytes, charge=self._charge, idle_s=self.idle_s
                )
            except (asyncio.IncompleteReadError, ConnectionError):
                return  # the client went away: the handler ends the session
            request = self._request(kind, payload)
            if request is None:
                return
            yield request

    def attach(self, order: StepOrder, requests: AsyncIterator[runtime_pb2.ExpertRequest]) -> None:
        self.order = order  # (its requests come from the connection's data callback, not from `requests`)

    def ready(self) -> None:
        """Hands the client's next request to the order, now if it is buffered, else when its bytes arrive. A step
        that is over at once (a re-sent step's reply, say) asks again from inside: that is looped here, not
        recursed (a client could buffer many such frames)."""
        if self._handing:
            self._again = True
            return
        self._handing = True
        try:
            self._again = True
            while self._again:
                self._again = False
                self._hand_over()
        finally:
            self._handing = False

    def _hand_over(self) -> None:
        order = self.order
        if order is None or order.ended:
            return
        conn = self.conn
        if conn.lost:  # no reply can reach the client: what it sent before leaving is not run
            order.client(None)
            return
        if conn.writing_paused:  # the client does not take its replies: its next request waits
            conn.on_writable = self.ready
            return
        self._release()
        try:
            frame = conn.take_frame(self.max_payload_bytes, self._charge)
            if frame is None:
                if conn.at_eof:
                    conn.stop_delivery()
                    order.client(None)  # the client went away: the session ends
                else:
                    conn.deliver(self.ready, idle_s=self.idle_s, fail=order.fail)
                return
            conn.stop_delivery()
            request = self._request(*frame)
        except Exception as e:
            conn.stop_delivery()
            order.fail(e)
            return
        order.client(request)

    def reply(self, response: runtime_pb2.ExpertResponse) -> None:
        self.conn.writelines(self.codec.encode(ls.MESSAGE, response.SerializeToString()))
        if self.timeline is not None:
            self.timeline.stamp(step_timeline.OUT)

    async def drain(self) -> None:
        await self.conn.drain()

    def detach(self) -> None:
        self.order = None
        self.conn.stop_delivery()
        self.conn.on_writable = None


async def serve_inference(
    handler: StreamRpcs,
    conn: FrameConnection,
    context: P2PContext,
    codec: FrameCodec,
    max_frame_bytes: int,
    *,
    lease: StreamLease | None = None,
    idle_s: float | None = None,
    rpc: str = "rpc_inference",
) -> None:
    """Runs one accepted connection's stream of `rpc` (one of `SERVED_RPCS`, checked at the hello) to its end (the last
    frame END, or ERROR with the handler's error text), then reads what the client still sends for up to `LINGER_S`
    before the caller closes. An inference stream's steps run without a task of their own (`SocketPort`, the
    handler's `serve_steps`); a training rpc's messages go through its stream generator."""
    timeline = step_timeline.open_stream()  # None unless the bench asked for step timelines
    port = SocketPort(conn, codec, max_frame_bytes, lease=lease, idle_s=idle_s, timeline=timeline)
    try:
        if rpc == "rpc_inference":
            await handler.serve_steps(port.requests(), context, port)
        else:
            async for response in _served(handler, rpc)(port.requests(), context):
                port.reply(response)
                await conn.drain()
        last = codec.encode(ls.END, b"")
    except Exception as e:  # reported to the client as the p2p stream would (the handler already logged it)
        last = codec.encode(ls.ERROR, (str(e) or repr(e)).encode()[: ls.MAX_ERROR_BYTES])
    finally:
        port.detach()
        if lease is not None:
            lease.close()
        step_timeline.close_stream(timeline)
    with contextlib.suppress(Exception):
        conn.writelines(last)
        conn.write_eof()
        await conn.discard_until_eof(LINGER_S)


def _served(
    handler: StreamRpcs, rpc: str
) -> Callable[[AsyncIterator[runtime_pb2.ExpertRequest], P2PContext], AsyncIterator[runtime_pb2.ExpertResponse]]:
    if rpc not in SERVED_RPCS:
        raise ValueError(f"rpc {rpc!r:.40} is not served here (only {', '.join(SERVED_RPCS)})")
    return getattr(handler, rpc)
