"""One `rpc_inference` stream served outside p2pd: frames in (`protocol.local_stream` framing, each payload opened by
a `FrameCodec`), `ExpertRequest`s into the handler's own `rpc_inference`, its responses out as frames. Shared by the
same-host socket (`local_endpoint`, plain frames) and the direct TCP port (`direct_endpoint`, sealed frames).

Every frame's declared length is checked against `max_frame_bytes` before its payload is read; where a `StreamLease` is
given (a remote peer's stream) the payload is charged to the handler's per-peer and total stream byte budget before
a byte of it is buffered and released once the handler has taken the next message, and a started payload that stops
arriving for `idle_s` ends the stream, as on p2p (`stream_guard`; one `TaskDeadline` timer per connection, moved as
bytes arrive, not a timeout task per read)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any, Protocol

from google.protobuf.message import DecodeError
from hivemind.p2p import P2PContext
from hivemind.proto import runtime_pb2

from corolla.protocol import local_stream as ls
from corolla.server.deadlines import TaskDeadline
from corolla.server.limits import StreamStalled
from corolla.server.stream_guard import StreamLease

READ_CHUNK_BYTES = 1 << 20
_timeout_at = getattr(asyncio, "timeout_at", None)  # Python >= 3.11 (TaskDeadline needs Task.uncancel)
LINGER_S = 2.0  # after its last frame, how long the server waits for the client to close its side


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


async def _read_payload(
    reader: asyncio.StreamReader, length: int, idle_s: float | None, deadlines: TaskDeadline | None
) -> bytes:
    if idle_s is None:
        return await reader.readexactly(length)
    if deadlines is None or _timeout_at is None:  # (Python < 3.11: a deadline needs a task of its own per read)
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
        try:
            chunk = await asyncio.wait_for(reader.read(min(length - len(data), READ_CHUNK_BYTES)), idle_s)
        except asyncio.TimeoutError:
            raise StreamStalled(f"the peer sent nothing for stream_idle_timeout={idle_s} s inside a message") from None
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
    handler: Any,
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    context: P2PContext,
    codec: FrameCodec,
    max_frame_bytes: int,
    *,
    lease: StreamLease | None = None,
    idle_s: float | None = None,
) -> None:
    """Runs one accepted connection's `rpc_inference` to its end (the last frame END, or ERROR with the handler's
    error text), then reads what the client still sends for up to `LINGER_S` before the caller closes."""
    charged = 0
    deadlines = TaskDeadline() if idle_s is not None else None

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
            yield request

    try:
        async for response in handler.rpc_inference(requests(), context):
            writer.writelines(codec.encode(ls.MESSAGE, response.SerializeToString()))
            await writer.drain()
        last = codec.encode(ls.END, b"")
    except Exception as e:  # reported to the client as the p2p stream would (the handler already logged it)
        last = codec.encode(ls.ERROR, (str(e) or repr(e)).encode()[: ls.MAX_ERROR_BYTES])
    finally:
        if lease is not None:
            lease.close()
        if deadlines is not None:
            deadlines.close()
    with contextlib.suppress(Exception):
        writer.writelines(last)
        writer.write_eof()
        await _discard_until_eof(reader, LINGER_S)


async def _discard_until_eof(reader: asyncio.StreamReader, timeout_s: float) -> None:
    """Reads (and drops) what the client still sends until it closes, for at most `timeout_s`: closing a socket
    with unread data resets the connection, and the client could lose our last frame."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while (remaining := deadline - loop.time()) > 0:
        if not await asyncio.wait_for(reader.read(1 << 16), remaining):
            return
