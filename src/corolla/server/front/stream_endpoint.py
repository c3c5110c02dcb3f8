"""Streams served outside p2pd, for the same-host socket (`local_endpoint`) and the direct port (`direct_endpoint`):
the connections a listener serves (`Connections`), the hello every connection starts with (`read_hello`,
`check_hello`), one connection from its hello to its close (`serve_connection`, the task's own coroutine: a listener's
code runs at the hello and at the end, not on each step's way), and one `rpc_inference` stream: frames in (`protocol.local_stream` framing, each payload opened by
a `FrameCodec`), `ExpertRequest`s into the handler's own `rpc_inference` (or the `rpc_forward_stream` /
`rpc_backward_stream` of a training call: the hello names the rpc), its responses out as frames. Shared by the
same-host socket (`local_endpoint`, plain frames) and the direct TCP port (`direct_endpoint`, sealed frames).

Every frame's declared length is checked against `max_frame_bytes` before its payload is read; where a `StreamLease` is
given (a remote peer's stream) the payload is charged to the handler's per-peer and total stream byte budget before
a byte of it is buffered and released once the handler has taken the next message, and a started payload that stops
arriving for `idle_s` ends the stream, as on p2p (`stream_guard`; one `TaskDeadline` timer per connection, moved as
bytes arrive, not a timeout task per read)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

from google.protobuf.message import DecodeError
from hivemind.p2p import P2PContext
from hivemind.proto import runtime_pb2

from corolla.protocol import local_stream as ls
from corolla.server.core.limits import StreamStalled
from corolla.server.front import step_timeline
from corolla.server.front.stream_guard import StreamLease, within_idle
from corolla.utils.deadlines import TASK_DEADLINES, TaskDeadline
from corolla.utils.logging import get_logger

logger = get_logger(__name__)

HELLO_TIMEOUT_S = 5.0  # a connection that has not said hello by then is dropped
# a training call's tensors (4-12 MiB a 512-token step of hidden 4096) through p2pd moved at ~100 MB/s on loopback:
# ~210 of a lone client's 529 ms step on an H200 (docs/decisions/0059)
SERVED_RPCS = ("rpc_inference", "rpc_forward_stream", "rpc_backward_stream")
CLOSE_WAIT_S = 10.0
READ_CHUNK_BYTES = 1 << 20
LINGER_S = 2.0  # after its last frame, how long the server waits for the client to close its side


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


async def read_hello(reader: asyncio.StreamReader) -> bytes:
    """The payload of a connection's first frame, which must be a HELLO (within `HELLO_TIMEOUT_S`: else
    `asyncio.TimeoutError`); ValueError for another kind or an oversized frame."""
    kind, payload = await asyncio.wait_for(ls.read_frame(reader, ls.MAX_HELLO_BYTES), HELLO_TIMEOUT_S)
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

    async def accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> AcceptedStream | None:
        """The connection's hello checked and answered (ACCEPT or ERROR); None: refused."""
        ...

    def ended(self, accepted: AcceptedStream | None) -> None:
        """The connection closed (after `accept`'s grant, if any)."""
        ...


async def serve_connection(
    listener: StreamListener, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
) -> None:
    """One connection's task: counted open while served (`Connections.serving`), its hello (`listener.accept`), then the
    stream of the rpc it named (the context's `handle_name`) to the end; the connection closed and `listener.ended`
    called whatever happens."""
    accepted: AcceptedStream | None = None
    try:
        with listener.connections.serving():
            accepted = await listener.accept(reader, writer)
            if accepted is not None:
                await serve_inference(
                    listener.handler, reader, writer, accepted.context, accepted.codec, listener.max_frame_bytes,
                    lease=accepted.lease, idle_s=accepted.idle_s, rpc=accepted.context.handle_name,
                )  # fmt: skip
    except (ConnectionError, asyncio.IncompleteReadError) as e:
        logger.debug(f"stream_endpoint.connection_lost({e!r})")
    finally:
        writer.close()
        listener.ended(accepted)


async def _read_payload(
    reader: asyncio.StreamReader, length: int, idle_s: float | None, deadlines: TaskDeadline | None
) -> bytes:
    if idle_s is None:
        return await reader.readexactly(length)
    if deadlines is None or not TASK_DEADLINES:  # (Python < 3.11: a deadline needs a task of its own per read)
        return await _read_payload_tasks(reader, length, idle_s)
    loop = deadlines.loop
    data = bytearray()  # grows only as bytes arrive (a declared length alone allocates nothing)
    try:
        with deadlines.scope(loop.time() + idle_s) as scope:  # one timer per connection, moved as bytes arrive
            while len(data) < length:
                chunk = await reader.read(min(length - len(data), READ_CHUNK_BYTES))
                if not chunk:
                    raise asyncio.IncompleteReadError(bytes(data), length)
                data += chunk
                scope.move(loop.time() + idle_s)
    except TimeoutError:
        if deadlines.expired:
            raise StreamStalled(f"the peer sent nothing for stream_idle_timeout={idle_s} s inside a message") from None
        raise
    return bytes(data)


async def _read_payload_tasks(reader: asyncio.StreamReader, length: int, idle_s: float) -> bytes:
    data = bytearray()
    while len(data) < length:
        chunk = await within_idle(reader.read(min(length - len(data), READ_CHUNK_BYTES)), idle_s, "inside a message")
        if not chunk:
            raise asyncio.IncompleteReadError(bytes(data), length)
        data += chunk
    return bytes(data)


async def read_frame(
    reader: asyncio.StreamReader,
    codec: FrameCodec,
    max_payload_bytes: int,
    *,
    lease: StreamLease | None = None,
    idle_s: float | None = None,
    deadlines: TaskDeadline | None = None,
) -> tuple[int, bytes, int]:
    """(kind, decoded payload, bytes charged to `lease`) of the next frame; ValueError for an unknown kind, a length
    over the limit, a payload that does not decode; IncompleteReadError at the end of the connection."""
    header = await reader.readexactly(ls.HEADER_BYTES)
    kind, length = ls.parse_header(header, max_payload_bytes + codec.overhead_bytes)
    charged = 0
    if lease is not None and kind == ls.MESSAGE:
        lease.charge(length)  # before a byte of the payload is buffered
        charged = length
    payload = await _read_payload(reader, length, idle_s, deadlines) if length else b""
    return kind, codec.decode(kind, payload), charged


async def serve_inference(
    handler: StreamRpcs,
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
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
    before the caller closes."""
    charged = 0
    deadlines = TaskDeadline() if idle_s is not None else None
    timeline = step_timeline.open_stream()  # None unless the bench asked for step timelines

    async def requests() -> AsyncIterator[runtime_pb2.ExpertRequest]:
        nonlocal charged
        while True:
            if lease is not None and charged:
                lease.release(charged)  # the handler took the previous message
                charged = 0
            try:
                kind, payload, charged = await read_frame(
                    reader, codec, max_frame_bytes, lease=lease, idle_s=idle_s, deadlines=deadlines
                )
            except (asyncio.IncompleteReadError, ConnectionError):
                return  # the client went away: the handler ends the session
            if kind == ls.END:
                return
            if kind != ls.MESSAGE:
                raise ValueError(f"expected a request frame, got kind {kind}")
            try:
                request = runtime_pb2.ExpertRequest.FromString(payload)
            except DecodeError as e:
                raise ValueError(f"request frame is not an ExpertRequest: {e}") from None
            if timeline is not None:
                timeline.request_read()
            yield request

    try:
        async for response in _served(handler, rpc)(requests(), context):
            writer.writelines(codec.encode(ls.MESSAGE, response.SerializeToString()))
            if timeline is not None:
                timeline.stamp(step_timeline.OUT)
            await writer.drain()
        last = codec.encode(ls.END, b"")
    except Exception as e:  # reported to the client as the p2p stream would (the handler already logged it)
        last = codec.encode(ls.ERROR, (str(e) or repr(e)).encode()[: ls.MAX_ERROR_BYTES])
    finally:
        if lease is not None:
            lease.close()
        if deadlines is not None:
            deadlines.close()
        step_timeline.close_stream(timeline)
    with contextlib.suppress(Exception):
        writer.writelines(last)
        writer.write_eof()
        await _discard_until_eof(reader, LINGER_S)


def _served(
    handler: StreamRpcs, rpc: str
) -> Callable[[AsyncIterator[runtime_pb2.ExpertRequest], P2PContext], AsyncIterator[runtime_pb2.ExpertResponse]]:
    if rpc not in SERVED_RPCS:
        raise ValueError(f"rpc {rpc!r:.40} is not served here (only {', '.join(SERVED_RPCS)})")
    return getattr(handler, rpc)


async def _discard_until_eof(reader: asyncio.StreamReader, timeout_s: float) -> None:
    """Reads (and drops) what the client still sends until it closes, for at most `timeout_s`: closing a socket
    with unread data resets the connection, and the client could lose our last frame."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while (remaining := deadline - loop.time()) > 0:
        if not await asyncio.wait_for(reader.read(1 << 16), remaining):
            return
