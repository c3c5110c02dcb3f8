"""Framed streams: the same-host socket's (`local_endpoint`) and the direct port's (`direct_endpoint`) connections, and
p2p's inference streams once `stream_guard` takes their connection from p2pd's. A decode step on every transport
crosses this file and no other of the transport's.

Every frame's declared length is checked against its bound before its payload is read; where a stream holds a lease
of the stream byte budget (`core.peer_bytes.StreamLease`: a remote peer's stream, the direct port's, p2p's) the
payload is charged to it before it is waited for and released once the handler has taken the next message, and a
started payload that stops arriving for `idle_s` ends the stream (`StreamStalled`)."""

from __future__ import annotations

import asyncio
import contextlib
import struct
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

from google.protobuf.message import DecodeError
from hivemind.p2p import P2PContext
from hivemind.proto import runtime_pb2
from hivemind.proto.p2pd_pb2 import RPCError

from corolla.protocol import local_stream as ls
from corolla.protocol.stream_frames import ERROR_MARKER, FRAME_HEADER_BYTES, MESSAGE_MARKER, frame_header
from corolla.server.core.limits import (
    MessagePace,
    PeerLimitExceeded,
    ReplyStalled,
    ServerLimitExceeded,
    StreamStalled,
    StreamTooSlow,
)
from corolla.server.core.peer_bytes import LoanPending, StreamLease
from corolla.server.front import step_timeline
from corolla.server.front.inference_stream import StepOrder, StepPort
from corolla.server.metrics import ServerMetrics
from corolla.utils.logging import get_logger

logger = get_logger(__name__)

HELLO_TIMEOUT_S = 5.0  # a connection that has not said hello by then is dropped
SERVED_RPCS = ("rpc_inference", "rpc_forward_stream", "rpc_backward_stream")
CLOSE_WAIT_S = 10.0
LINGER_S = 2.0  # after its last frame, how long the server waits for the client to close its side
CLOSE_FLUSH_S = 5.0  # after a close, how long what waits to go out may wait for the peer to take it


DEFAULT_LIMIT_BYTES = 1 << 16
INSIDE_A_MESSAGE = "inside a message"


class FrameConnection(asyncio.Protocol):
    """A connection as an asyncio `Protocol` that hands out whole frames, in place of a `StreamReader`/`StreamWriter`
    pair: taken by a task (`read_frame`: one wait for the bytes the frame still needs) or by a callback (`deliver`: no
    task woken, an inference stream's steps). A declared length is checked, and charged where asked, when its header is
    parsed; a frame begun that stops arriving for `idle_s` ends the stream (`StreamStalled`: one timer per wait,
    re-armed when it fires early). Reading pauses while more than `2 * limit_bytes` wait unread, as a `StreamReader`'s
    does; writing follows the transport's flow control (`drain`, `writing_paused`, `on_writable`).

    `serve`, where given, runs as the connection's task (a listener's protocol factory). The header is the local
    stream's unless `header_bytes` and `parse_header` name another (a p2pd stream taken over: `PeerFrames`)."""

    def __init__(
        self,
        limit_bytes: int = DEFAULT_LIMIT_BYTES,
        serve: Callable[[FrameConnection], Coroutine[Any, Any, None]] | None = None,
        *,
        header_bytes: int = ls.HEADER_BYTES,
        parse_header: Callable[[bytearray, int], tuple[int, int]] = ls.parse_header,
    ):
        self.transport: asyncio.Transport | None = None
        self._header_bytes, self._parse_header = header_bytes, parse_header
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
        self._timer: asyncio.TimerHandle | None = None  # the pending wait's idle (and pace) timer
        # the pending `read_frame` wait's idle limit, pace and failure, armed by the first byte of a frame (`_started`)
        self._wait_idle: tuple[float | None, MessagePace | None, Callable[[BaseException], None]] | None = None
        self._frame_clock: float | None = None  # when the server began waiting for the frame begun (its pace's start)
        self._paced_before = 0  # bytes on the pace's clock before the frame begun (`read_frame`'s `before_bytes`)
        self.task: asyncio.Task[None] | None = None

    @classmethod
    def take_over(cls, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, **kwargs: Any) -> FrameConnection:
        """The connection a `StreamReader` was reading (a p2pd stream, whose header hivemind's listener read): its
        transport is this protocol's from now on, with what the reader had buffered and whether its input had ended.
        (asyncio has no public way to take a reader's buffer: its `_buffer` and `_eof`, alike from 3.8 to 3.13.)"""
        conn = cls(**kwargs)
        transport = writer.transport
        assert isinstance(transport, asyncio.Transport)
        transport.set_protocol(conn)
        conn.connection_made(transport)
        buffered: bytearray | None = getattr(reader, "_buffer", None)
        if buffered:
            conn._buffer += buffered
            buffered.clear()
        if getattr(reader, "_eof", False) or transport.is_closing():
            conn.at_eof = True
        elif not transport.is_reading():  # (the reader had paused it: its buffer was full)
            transport.resume_reading()
        return conn

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
            elif self._wait_idle is not None and self._timer is None:  # a frame begun during the wait
                self._arm_idle(*self._wait_idle)
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
        self._writable()  # nothing will be written: who waits to write is told (`on_writable`)

    def pause_writing(self) -> None:
        self.writing_paused = True

    def resume_writing(self) -> None:
        waiter = self._drain_waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)
        self._writable()

    def _writable(self) -> None:
        self.writing_paused = False
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
            if len(buffer) < self._header_bytes:
                return None
            header = self._parse_header(buffer, max_payload_bytes)
            if charge is not None and header[0] == ls.MESSAGE:
                charge(header[1])
            self._header = header
        kind, length = header
        start = self._header_bytes
        end = start + length
        if len(buffer) < end:
            return None
        self._header = None
        self._frame_clock, self._paced_before = None, 0
        payload = bytes(buffer[start:end]) if length else b""
        del buffer[:end]
        if len(buffer) <= self._limit:
            self._resume_reading()
        return kind, payload

    @property
    def frame_arriving(self) -> bool:
        """A frame's header is read (its length charged where asked) and its payload is not all here yet."""
        return self._header is not None

    @property
    def _started(self) -> bool:
        """Some of the next frame is buffered (its header, or part of it): the rest must come within `idle_s`."""
        return self._header is not None or len(self._buffer) > 0

    @property
    def header_bytes(self) -> int:
        """A frame's header bytes on this connection."""
        return self._header_bytes

    def _needed(self) -> int:
        """The bytes the next frame needs buffered: its header, or (parsed) the whole frame."""
        return self._header_bytes if self._header is None else self._header_bytes + self._header[1]

    def _resume_reading(self) -> None:
        if self._reading_paused and self.transport is not None:
            self._reading_paused = False
            self.transport.resume_reading()

    def _arm_idle(self, idle_s: float | None, pace: MessagePace | None, fail: Callable[[BaseException], None]) -> None:
        """`fail(StreamStalled)` once no byte came for `idle_s` (from now, then from the last byte), or
        `fail(StreamTooSlow)` once the frame begun is not whole within its `pace` (from the first time it was waited
        for: its clock runs on across waits until the frame is taken or delivery stops)."""
        assert self._loop is not None
        if self._timer is None and (idle_s is not None or pace is not None):
            now = self._loop.time()
            self._last_data_at = now
            if self._frame_clock is None:
                self._frame_clock = now
            self._timer = self._loop.call_at(self._due(idle_s, pace)[0], self._idle_check, idle_s, pace, fail)

    def _due(self, idle_s: float | None, pace: MessagePace | None) -> tuple[float, bool]:
        """(when the wait for the frame begun fails, whether for its pace): the frame's size is its header until the
        header is parsed, then the whole frame."""
        due, slow = (float("inf") if idle_s is None else self._last_data_at + idle_s), False
        if pace is not None and self._frame_clock is not None:
            pace_due = self._frame_clock + pace.allowed_s(self._paced_before + self._needed())
            if pace_due < due:
                due, slow = pace_due, True
        return due, slow

    def _idle_check(
        self, idle_s: float | None, pace: MessagePace | None, fail: Callable[[BaseException], None]
    ) -> None:
        assert self._loop is not None
        self._timer = None
        due, slow = self._due(idle_s, pace)
        if due > self._loop.time():
            self._timer = self._loop.call_at(due, self._idle_check, idle_s, pace, fail)
        elif slow:
            assert pace is not None
            nbytes = self._paced_before + self._needed()
            fail(StreamTooSlow(
                f"a message of {nbytes} bytes did not arrive within {pace.allowed_s(nbytes):.1f} s "
                f"({pace})"
            ))  # fmt: skip
        else:
            fail(StreamStalled(f"the peer sent nothing for stream_idle_timeout={idle_s} s {INSIDE_A_MESSAGE}"))

    def _cancel_idle(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    async def read_frame(
        self,
        max_payload_bytes: int,
        *,
        charge: Callable[[int], None] | None = None,
        idle_s: float | None = None,
        pace: MessagePace | None = None,
        since: float | None = None,
        before_bytes: int = 0,
    ) -> tuple[int, bytes]:
        """The next (kind, payload) (`take_frame`), waiting for its bytes: IncompleteReadError at the end of the input,
        StreamStalled after `idle_s` without a byte inside a frame begun (None: no limit), StreamTooSlow where the frame
        begun is not whole within its `pace` (None: no minimum rate). `since` (a loop time): the frame is a part of a
        request paced as a whole, `before_bytes` of it since then: the pace runs from `since` over those bytes and
        the frame's, the wait for its first byte included (and `idle_s` from the wait's start)."""
        while (frame := self.take_frame(max_payload_bytes, charge)) is None:
            if since is not None and pace is not None:
                self._frame_clock, self._paced_before = since, before_bytes
            await self._wait_for(self._needed(), idle_s, pace, whole=since is not None)
        return frame

    async def _wait_for(
        self, nbytes: int, idle_s: float | None, pace: MessagePace | None = None, *, whole: bool = False
    ) -> None:
        """Until `nbytes` are buffered (one wake-up, when they are) or the input ends; StreamStalled after `idle_s`
        without a byte once a frame has begun (now, or when its first bytes arrive during the wait; `whole`: from the
        wait's start, a part of a request), StreamTooSlow past its `pace`."""
        if self.at_eof:
            raise asyncio.IncompleteReadError(bytes(self._buffer), nbytes)
        loop = self._loop
        assert loop is not None
        self._resume_reading()
        waiter = self._waiter = loop.create_future()
        self._want = nbytes
        if idle_s is not None or pace is not None:

            def stalled(error: BaseException) -> None:
                if not waiter.done():
                    waiter.set_exception(error)

            self._wait_idle = (idle_s, pace, stalled)
            if self._started or whole:
                self._arm_idle(idle_s, pace, stalled)
        try:
            await waiter
        finally:
            self._waiter, self._want, self._wait_idle = None, 0, None
            self._cancel_idle()

    def deliver(
        self,
        on_data: Callable[[], None],
        *,
        idle_s: float | None = None,
        pace: MessagePace | None = None,
        fail: Callable[[BaseException], None],
    ) -> None:
        """Calls `on_data` as bytes or the end of the input arrive, until `stop_delivery` (it takes frames itself with
        `take_frame`); `fail(StreamStalled)` where a frame begun stops arriving for `idle_s`, `fail(StreamTooSlow)`
        where it is not whole within its `pace`."""
        self._on_data = on_data
        self._resume_reading()
        if self._started:
            self._arm_idle(idle_s, pace, fail)

    def stop_delivery(self) -> None:
        """No more `on_data` calls; a frame begun gets a new pace clock when it is waited for again (the server, not
        the peer, stopped taking it: its replies wait, say)."""
        self._on_data = None
        self._frame_clock = None
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
        """Closes the connection (`close_transport`)."""
        if self.transport is not None:
            close_transport(self.transport)


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


async def read_hello(
    conn: FrameConnection, max_bytes: int = ls.MAX_HELLO_BYTES, timeout_s: float = HELLO_TIMEOUT_S
) -> bytes:
    """The payload of a connection's next frame, which must be a HELLO of at most `max_bytes` (within `timeout_s`:
    else `asyncio.TimeoutError`); ValueError for another kind or an oversized frame (refused at its header, before
    its payload is buffered)."""
    kind, payload = await asyncio.wait_for(conn.read_frame(max_bytes), timeout_s)
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
    check_served(rpc)


def check_served(rpc: str) -> None:
    if rpc not in SERVED_RPCS:
        raise ValueError(f"rpc {rpc!r:.40} is not served here (only {', '.join(SERVED_RPCS)})")


class StreamRpcs(Protocol):
    """What a stream endpoint serves: the p2p front's own streamed rpcs (`handler.TransformerConnectionHandler`,
    `SERVED_RPCS`), so every transport shares its decoder, sessions, training batches and refusals."""

    max_stream_bytes: int  # the largest message the front takes (a frame's payload bound follows from it)
    metrics: ServerMetrics  # counts a reply the client did not take (`ReplyStalled`)

    async def serve_steps(  # `rpc_inference`
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

    def message_head(self, nbytes: int) -> bytes | None:
        """The header of a MESSAGE frame whose payload of `nbytes` goes out as it is, to be written together with it
        (what `encode` writes before it); None where `encode` transforms the payload."""
        ...


class PlainFrames:
    """The same-host socket's frames: payloads as they are."""

    overhead_bytes = 0

    def encode(self, kind: int, payload: bytes) -> list[bytes]:
        return ls.frame(kind, payload)  # the payload is not copied

    def decode(self, kind: int, payload: bytes) -> bytes:
        return payload

    def message_head(self, nbytes: int) -> bytes | None:
        return ls.header(ls.MESSAGE, nbytes)


_PEER_HEADER = struct.Struct(">BQ")  # hivemind's marker byte and 8-byte big-endian length
MAX_END_BYTES = 64 * 1024  # the caller's end-of-stream (an `RPCError`): small, read and ignored


class PeerFrames(PlainFrames):
    """A p2pd stream's frames (hivemind's framing, `protocol.stream_frames`, which stock Petals peers read and write)
    in the local stream's kinds: a message is MESSAGE, the caller's end-of-stream (the error marker: an empty `RPCError`
    from a stock client, its text not read) is END; an ERROR written goes out as an `RPCError` with its text. Payloads
    as they are."""

    header_bytes = FRAME_HEADER_BYTES

    @staticmethod
    def parse_header(buffer: bytes | bytearray, max_payload_bytes: int) -> tuple[int, int]:
        """(kind, payload length) of the frame `buffer` begins with; ValueError for an unknown marker, an end-of-stream
        over `MAX_END_BYTES` or a message over `max_payload_bytes`."""
        marker, length = _PEER_HEADER.unpack_from(buffer)
        if marker == ERROR_MARKER:
            if length > MAX_END_BYTES:
                raise ValueError(f"end-of-stream message of {length} bytes is larger than {MAX_END_BYTES}")
            return ls.END, length
        if marker != MESSAGE_MARKER:
            raise ValueError("invalid stream message marker")
        if length > max_payload_bytes:
            raise ValueError(f"stream message of {length} bytes exceeds the limit of {max_payload_bytes} bytes")
        return ls.MESSAGE, length

    def encode(self, kind: int, payload: bytes) -> list[bytes]:
        if kind == ls.ERROR:
            payload = RPCError(message=payload.decode(errors="replace")).SerializeToString()
            return [frame_header(ERROR_MARKER, len(payload)), payload]
        if kind != ls.MESSAGE:
            raise ValueError(f"a p2pd stream has no frame of kind {kind}")
        return [frame_header(MESSAGE_MARKER, len(payload)), payload]  # the payload is not copied

    def message_head(self, nbytes: int) -> bytes | None:
        return frame_header(MESSAGE_MARKER, nbytes)


@dataclass(frozen=True)
class AcceptedStream:
    """What a listener's hello check grants a connection: its stream's context, framing and budget."""

    context: P2PContext
    codec: FrameCodec
    lease: StreamLease | None = None  # a remote peer's stream: its payloads charged to the handler's budget
    idle_s: float | None = None
    peer: str | None = None  # the remote peer the listener admitted (None: the same host's)
    pace: MessagePace | None = None  # the minimum rate of a message in flight, both ways (None: none)


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
                    lease=accepted.lease, idle_s=accepted.idle_s, pace=accepted.pace, rpc=accepted.context.handle_name,
                )  # fmt: skip
    except (ConnectionError, asyncio.IncompleteReadError) as e:
        logger.debug(f"stream_endpoint.connection_lost({e!r})")
    finally:
        conn.close()
        listener.ended(accepted)


class SocketPort:
    """One accepted connection's requests and replies: `requests()` for a task (an rpc's stream, a session's opening
    and KV import), and, once an inference session runs steps, its `inference_stream.StepPort` (the client's next
    request handed over from the connection's data callback, each reply written as it is made: no task per step)."""

    def __init__(
        self, conn: FrameConnection, codec: FrameCodec, max_frame_bytes: int, *,
        lease: StreamLease | None, idle_s: float | None, timeline: step_timeline.StreamTimeline | None,
        pace: MessagePace | None = None,
    ):  # fmt: skip
        self.conn, self.codec, self.lease, self.idle_s, self.timeline = conn, codec, lease, idle_s, timeline
        self.pace = pace
        if lease is not None:
            lease.conn = conn  # (a reclaim cuts it, decision 0212)
        self.max_payload_bytes = max_frame_bytes + codec.overhead_bytes
        self.charged = 0  # the last message's bytes in `lease`, released once the handler takes the next
        self._charge = None if lease is None else self._charge_lease
        self.order: StepOrder | None = None
        self.input_over = False  # the client's input ended (its END frame, or a failure `_input_failed` took)
        self._handing = False  # inside `ready`
        self._again = False  # `ready` was called again meanwhile
        self._on_data, self._on_input_error = self.ready, self._input_error  # (bound once: handed over every step)

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
            self.input_over = True
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

    def _input_failed(self, error: Exception) -> bool:
        """Whether a failure to read the client's input only ends that input (True: the session ends as at the end of
        its stream) or ends the session with it (False: answered as the session's error). The socket's: the client
        went away (True), anything else (False)."""
        if isinstance(error, (asyncio.IncompleteReadError, ConnectionError)):
            self.input_over = True
            return True
        return False

    async def requests(self, *, whole: bool = False) -> AsyncIterator[runtime_pb2.ExpertRequest]:
        """The client's requests, each frame within the pace; `whole`: the frames are the parts of one request (a
        training rpc's), paced as one from the first wait (a clock per part would let small parts, each inside its own
        grace, move at a few bytes a second), none waited for past `idle_s`, and all kept charged to the lease until
        the stream ends (the method holds them all, as p2p's `guarded_stream_handler` keeps them charged)."""
        conn = self.conn
        since = asyncio.get_running_loop().time() if whole else None
        received = 0  # the request's bytes so far, on the wire
        if whole and self.lease is not None:
            self.lease.gathering = True  # (until its END: the parts wait for their peer, not for the handler)
        try:
            while True:
                if not whole:
                    self._release()
                try:
                    kind, payload = await conn.read_frame(
                        self.max_payload_bytes, charge=self._charge, idle_s=self.idle_s, pace=self.pace, since=since,
                        before_bytes=received,
                    )  # fmt: skip
                    received += conn.header_bytes + len(payload)
                    request = self._request(kind, payload)
                except LoanPending as pending:  # (handler processes) the frame is taken again once the core answered
                    await asyncio.wait((pending.future,))
                    continue
                except Exception as e:
                    if self._input_failed(e):
                        return
                    raise
                if request is None:
                    return
                yield request
        finally:
            if self.lease is not None:
                self.lease.gathering = False

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
            self._input_failed(ConnectionResetError("Connection lost"))
            order.client(None)
            return
        if conn.writing_paused:  # the client does not take its replies: its next request waits, and so do its bytes
            conn.stop_delivery()  # (reading pauses once 2 x limit wait unread, as between steps)
            conn.on_writable = self.ready
            return
        self._release()
        try:
            frame = conn.take_frame(self.max_payload_bytes, self._charge)
            if frame is None:
                if conn.at_eof:
                    conn.stop_delivery()
                    self._input_failed(asyncio.IncompleteReadError(b"", None))
                    order.client(None)  # the client went away: the session ends
                else:
                    conn.deliver(self._on_data, idle_s=self.idle_s, pace=self.pace, fail=self._on_input_error)
                return
            conn.stop_delivery()
            request = self._request(*frame)
        except LoanPending as pending:  # (handler processes) the frame is taken again once the core answered
            conn.stop_delivery()
            pending.future.add_done_callback(self._loaned)
            return
        except Exception as e:
            conn.stop_delivery()
            self._input_error(e)
            return
        order.client(request)

    def _loaned(self, _: asyncio.Future[None]) -> None:
        self.ready()

    def _input_error(self, error: BaseException) -> None:
        """The client's input failed (a refused frame, a stalled payload): its end, or the session's error."""
        order = self.order
        if order is None or order.ended:
            return
        if isinstance(error, Exception) and self._input_failed(error):
            order.client(None)
        else:
            order.fail(error)

    def reply(self, response: runtime_pb2.ExpertResponse | bytes) -> None:
        payload = response if isinstance(response, bytes) else response.SerializeToString()
        self.conn.writelines(self.codec.encode(ls.MESSAGE, payload))
        if self.timeline is not None:
            self.timeline.stamp(step_timeline.OUT)

    def reply_joined(self, parts: tuple[bytes | memoryview, ...], nbytes: int) -> memoryview:
        head = self.codec.message_head(nbytes)
        if head is None:  # (a sealed connection: the payload is encoded)
            payload = b"".join(parts)
            self.reply(payload)
            return memoryview(payload)
        frame = b"".join((head, *parts))  # the frame as `reply` writes it, in one buffer
        self.conn.write(frame)
        if self.timeline is not None:
            self.timeline.stamp(step_timeline.OUT)
        return memoryview(frame)[len(head) :]

    async def drain(self) -> None:
        await self.conn.drain()

    def detach(self) -> None:
        self.order = None
        self.conn.stop_delivery()
        self.conn.on_writable = None


STREAM_REFUSALS = (PeerLimitExceeded, ServerLimitExceeded, StreamStalled, ValueError)  # a stream's input refused


class PeerStreamPort(SocketPort):
    """A p2pd stream's `SocketPort` (`stream_guard`'s `rpc_inference` handler, over a connection taken from hivemind's
    reader, `PeerFrames`): as the socket's, but a refused input (`STREAM_REFUSALS`: a message over a byte budget, a
    stalled payload, a malformed frame) only ends the client's input and is kept in `refused`, for the handler to
    count and answer once the session is over; and an input that breaks off (the caller closed or died, mid-message or
    without its end-of-stream) is `broken`: nobody is answered (as hivemind's own stream handler)."""

    refused: BaseException | None = None
    broken = False
    on_open: Callable[[], None] | None = None  # called once, when a session attaches (`OpeningStreams.leave`)

    def attach(self, order: StepOrder, requests: AsyncIterator[runtime_pb2.ExpertRequest]) -> None:
        super().attach(order, requests)
        on_open, self.on_open = self.on_open, None
        if on_open is not None:
            on_open()

    def _input_failed(self, error: Exception) -> bool:
        if isinstance(error, (asyncio.IncompleteReadError, ConnectionError)):
            self.broken = True
        elif isinstance(error, STREAM_REFUSALS):
            if self.refused is None:
                self.refused = error
        else:
            return False
        self.input_over = True
        return True

    async def drop_rest(self, timeout_s: float) -> None:
        """Reads (and drops) what is left of the client's input up to its end-of-stream, for at most `timeout_s`: a
        unix socket closed with unread bytes resets, and p2pd may then drop the reply it has not delivered yet."""

        async def drop() -> None:
            async for _ in self.requests():
                pass

        with contextlib.suppress(asyncio.TimeoutError, Exception):
            await asyncio.wait_for(drop(), timeout_s)


async def serve_inference(
    handler: StreamRpcs,
    conn: FrameConnection,
    context: P2PContext,
    codec: FrameCodec,
    max_frame_bytes: int,
    *,
    lease: StreamLease | None = None,
    idle_s: float | None = None,
    pace: MessagePace | None = None,
    rpc: str = "rpc_inference",
) -> None:
    """Runs one accepted connection's stream of `rpc` (one of `SERVED_RPCS`, checked at the hello) to its end (the last
    frame END, or ERROR with the handler's error text), then reads what the client still sends for up to `LINGER_S`
    before the caller closes. An inference stream's steps run without a task of their own (`SocketPort`, the
    handler's `serve_steps`); a training rpc's messages go through its stream generator, each reply taken by the
    client within its `pace` (`drain_reply`), else the connection is dropped with what waits to go out (counted,
    `ReplyStalled`)."""
    timeline = step_timeline.open_stream()  # None unless the bench asked for step timelines
    port = SocketPort(conn, codec, max_frame_bytes, lease=lease, idle_s=idle_s, timeline=timeline, pace=pace)
    try:
        if rpc == "rpc_inference":
            await handler.serve_steps(port.requests(), context, port)
        else:
            check_served(rpc)
            async for response in getattr(handler, rpc)(port.requests(whole=True), context):
                port.reply(response)
                await drain_reply(conn.drain(), response.ByteSize(), pace)
        last = codec.encode(ls.END, b"")
    except ReplyStalled as e:  # the client does not take its replies: nothing more is said to it
        handler.metrics.rejected(e.reason)
        logger.info(f"{rpc}.rejected(reason={e.reason}): {e}")
        if conn.transport is not None:
            conn.transport.abort()
        return
    except Exception as e:  # reported to the client as the p2p stream would (the handler already logged it)
        last = codec.encode(ls.ERROR, ls.error_text(e))
    finally:
        port.detach()
        if lease is not None:
            lease.close()
        step_timeline.close_stream(timeline)
    with contextlib.suppress(Exception):
        conn.writelines(last)
        conn.write_eof()
        await conn.discard_until_eof(LINGER_S)


def close_transport(transport: asyncio.BaseTransport) -> None:
    """Closes a connection once what waits to go out is sent, or drops it after `CLOSE_FLUSH_S`: a peer that takes none
    of it would otherwise hold the socket and the buffer for as long as it keeps its side open."""
    transport.close()
    if isinstance(transport, asyncio.WriteTransport) and transport.get_write_buffer_size():
        asyncio.get_running_loop().call_later(CLOSE_FLUSH_S, transport.abort)


async def drain_reply(drain: Awaitable[None], nbytes: int, pace: MessagePace | None) -> None:
    """`drain` (a transport's: back under its high-water mark) awaited for a reply of `nbytes` just written, within
    the reply's `pace` (None: as long as the peer takes); ReplyStalled past it: a peer that never reads would otherwise
    hold the reply's bytes and its stream's task for good."""
    if pace is None:
        await drain
        return
    allowed_s = pace.allowed_s(nbytes)
    try:
        await asyncio.wait_for(drain, allowed_s)
    except asyncio.TimeoutError:
        raise ReplyStalled(
            f"the peer did not take a reply of {nbytes} bytes within {allowed_s:.1f} s ({pace})"
        ) from None
