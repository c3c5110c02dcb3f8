"""p2p's streamed RPCs (`rpc_*_stream`, `rpc_inference`) with bounded reading: the same wire framing as hivemind's
protobuf stream handler (marker byte, 8-byte length, message; an error marker ends the input), but a message's
declared length is checked and charged to per-stream, per-peer and global byte budgets (`stream_endpoint`'s
`StreamBudget`) BEFORE its bytes are read, a peer that stops sending mid-message (or between the parts of a forward
stream) is cut off after `stream_idle_timeout_s`, and every charged byte is given back when the message is processed
or the stream ends. An inference stream's steps run by callbacks over the connection taken from hivemind's reader, as
the socket's do (`steps_handler`); a forward or backward stream is read by a task and gathered (`guarded_stream_handler`);
`register_handlers` registers them all."""

from __future__ import annotations

import asyncio
import functools
import logging
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import suppress
from typing import Any

from hivemind.p2p import P2P, P2PContext
from hivemind.proto import runtime_pb2
from hivemind.proto.p2pd_pb2 import RPCError

from corolla.protocol import local_stream as ls
from corolla.protocol.stream_frames import ERROR_MARKER, MESSAGE_MARKER, frame_header
from corolla.server.core.limits import (
    MessagePace,
    MiB,
    PeerLimitExceeded,
    ReplyStalled,
    StreamStalled,
    StreamTooSlow,
    peer_key,
)
from corolla.server.front import step_timeline
from corolla.server.front.inference_stream import StepPort
from corolla.server.front.opening_streams import OpeningStreams
from corolla.server.front.stream_endpoint import (
    STREAM_REFUSALS,
    FrameConnection,
    PeerFrames,
    PeerStreamPort,
    StreamBudget,
    StreamLease,
    close_transport,
    drain_reply,
)
from corolla.utils.deadlines import TASK_DEADLINES, TaskDeadline
from corolla.utils.logging import get_logger

logger = get_logger(__name__)

READ_CHUNK_BYTES = 1 * MiB
MAX_PREFETCH_MESSAGES = 5  # as hivemind's handler: messages read ahead of the one being processed
# streams of steps, served by callbacks (`steps_handler`), each governed by the session's own step timeout
STEP_RPCS = ("rpc_inference",)
FINISH_INPUT_S = 1.0  # after the reply: how long the rest of a caller's input is read (and dropped) before closing
FINISH_INPUT_POLL_S = 0.01  # how often the dropped messages are taken off the full read-ahead queue meanwhile


ONE_WRITE_MAX_BYTES = 1 * MiB  # a reply up to this size goes out in one write (one copy of its body)


async def send_message(
    message: runtime_pb2.ExpertResponse | RPCError, writer: asyncio.StreamWriter, pace: MessagePace | None = None
) -> None:
    """hivemind's framing (marker byte, 8-byte length, body), the bytes `P2P.send_protobuf` writes, but as one write
    where the body is small: one `send` and one wake-up of `p2pd` per reply instead of three. The peer must take it
    within its `pace` (`stream_endpoint.drain_reply`: ReplyStalled)."""
    body = message.SerializeToString()
    header = frame_header(ERROR_MARKER if isinstance(message, RPCError) else MESSAGE_MARKER, len(body))
    if len(body) <= ONE_WRITE_MAX_BYTES:
        writer.write(header + body)
    else:  # large forward/backward replies: no copy of the body
        writer.write(header)
        writer.write(body)
    await drain_reply(writer.drain(), len(header) + len(body), pace)


async def within_idle(
    awaitable: Any,
    timeout_s: float | None,
    what: str,
    *,
    paced_until: float | None = None,
    pace: MessagePace | None = None,
) -> Any:
    """`awaitable` within `timeout_s` (None or 0: no limit), else StreamStalled naming `what`; and before the loop time
    `paced_until` (the message's `pace`), else StreamTooSlow (Python 3.10's reads: a `wait_for` task each)."""
    slow = False
    if paced_until is not None:
        pace_s = max(paced_until - asyncio.get_running_loop().time(), 0.0)
        if not timeout_s or pace_s < timeout_s:
            timeout_s, slow = pace_s, True
    if timeout_s is None or (not timeout_s and not slow):
        return await awaitable
    try:
        return await asyncio.wait_for(awaitable, timeout_s)
    except asyncio.TimeoutError:
        if slow and pace is not None:
            raise _too_slow(pace) from None
        raise StreamStalled(f"the peer sent nothing for stream_idle_timeout={timeout_s} s {what}") from None


def _too_slow(pace: MessagePace) -> StreamTooSlow:
    return StreamTooSlow(f"a request did not arrive at {pace}")


async def read_message(
    reader: asyncio.StreamReader,
    lease: StreamLease,
    *,
    idle_s: float,
    between_s: float | None,
    pace: MessagePace | None = None,
    since: float | None = None,
    before_bytes: int = 0,
    deadlines: TaskDeadline | None = None,
) -> tuple[runtime_pb2.ExpertRequest | None, int]:
    """One framed message (None at the end of the input) and the bytes it was charged. A message begun (its marker
    read) must be whole within its `pace` (StreamTooSlow) and must not stop for `idle_s` (StreamStalled). A part of
    a streamed request is paced with the parts before it (`before_bytes` on the wire since the loop time `since`, its
    marker's wait included): a clock per part would let a request of many small parts, each whole within its own
    grace, move at a few bytes a second. On Python
    >= 3.11 the deadlines of its reads (`between_s` for the marker, the earlier of `idle_s` from the start of every
    later read and the message's pace) are one scope of the reading task's `TaskDeadline` (`deadlines`: one per
    stream, its timer moved lazily) instead of an `asyncio.wait_for` task per read."""
    if not TASK_DEADLINES:
        return await _read_message_tasks(
            reader, lease, idle_s=idle_s, between_s=between_s, pace=pace, since=since, before_bytes=before_bytes
        )
    if deadlines is None:
        deadlines = TaskDeadline()
    loop = deadlines.loop  # (the stream's loop: no get_running_loop, a getpid() syscall, per message)
    limit_s: float | None = between_s or None
    what = "between the parts of a streamed request"
    inside_s = idle_s or None
    # the loop time by which the message (its marker, then header, then whole frame) must be in (None: no pace)
    paced_until = None if pace is None or since is None else since + pace.allowed_s(before_bytes + 1)
    slow = False  # the scope's deadline is the pace's

    def until() -> float | None:
        """The deadline of the next read: `limit_s` from now or the pace's, the earlier."""
        nonlocal slow
        due = None if limit_s is None else loop.time() + limit_s
        slow = paced_until is not None and (due is None or paced_until < due)
        return paced_until if slow else due

    try:
        with deadlines.scope(until()) as scope:
            marker = await reader.readexactly(1)
            what, limit_s = "inside a message", inside_s
            started = loop.time() if since is None else since  # the message's pace runs from its marker, or the parts'
            if pace is not None:
                paced_until = started + pace.allowed_s(before_bytes + 1 + P2P.HEADER_LEN)
            scope.move(until())
            header = await reader.readexactly(P2P.HEADER_LEN)
            kind, length = PeerFrames.parse_header(marker + header, sys.maxsize)
            if pace is not None:
                paced_until = started + pace.allowed_s(before_bytes + 1 + P2P.HEADER_LEN + length)
            if kind == ls.END:  # the caller's end-of-stream (or its error): small, read and ignore
                scope.move(until())
                await reader.readexactly(length)
                return None, 0
            lease.charge(length)  # before a single byte of the body is buffered
            data: bytes | bytearray = b""
            if length:  # the usual step: its whole body in one read (what has arrived, at most `length`)
                scope.move(until())
                data = await reader.read(min(length, READ_CHUNK_BYTES))
                if not data:
                    raise asyncio.IncompleteReadError(b"", length)
            if len(data) < length:
                data = bytearray(data)  # grows only as bytes arrive (a declared length alone allocates nothing)
                while len(data) < length:
                    scope.move(until())
                    chunk = await reader.read(min(length - len(data), READ_CHUNK_BYTES))
                    if not chunk:
                        raise asyncio.IncompleteReadError(b"", length - len(data))
                    data += chunk
    except TimeoutError:
        if deadlines.expired:
            if slow and pace is not None:
                raise _too_slow(pace) from None
            raise StreamStalled(f"the peer sent nothing for stream_idle_timeout={limit_s} s {what}") from None
        raise
    request = runtime_pb2.ExpertRequest()
    request.ParseFromString(memoryview(data))
    return request, length


async def _read_message_tasks(
    reader: asyncio.StreamReader,
    lease: StreamLease,
    *,
    idle_s: float,
    between_s: float | None,
    pace: MessagePace | None,
    since: float | None,
    before_bytes: int,
) -> tuple[runtime_pb2.ExpertRequest | None, int]:
    """`read_message` on Python 3.10 (no `asyncio.timeout`): an `asyncio.wait_for` per bounded read."""
    marker_until = None if pace is None or since is None else since + pace.allowed_s(before_bytes + 1)
    marker = await within_idle(
        reader.readexactly(1), between_s, "between the parts of a streamed request", paced_until=marker_until, pace=pace
    )
    started = asyncio.get_running_loop().time() if since is None else since  # from its marker, or the parts'
    paced_until = None if pace is None else started + pace.allowed_s(before_bytes + 1 + P2P.HEADER_LEN)
    inside = functools.partial(within_idle, what="inside a message", pace=pace)
    header = await inside(reader.readexactly(P2P.HEADER_LEN), idle_s, paced_until=paced_until)
    kind, length = PeerFrames.parse_header(marker + header, sys.maxsize)
    paced_until = None if pace is None else started + pace.allowed_s(before_bytes + 1 + P2P.HEADER_LEN + length)
    if kind == ls.END:  # the caller's end-of-stream (or its error): small, read and ignore
        await inside(reader.readexactly(length), idle_s, paced_until=paced_until)
        return None, 0
    lease.charge(length)  # before a single byte of the body is buffered
    data = bytearray()  # grows only as bytes arrive (a declared length alone allocates nothing)
    while len(data) < length:
        chunk = await inside(reader.read(min(length - len(data), READ_CHUNK_BYTES)), idle_s, paced_until=paced_until)
        if not chunk:
            raise asyncio.IncompleteReadError(b"", length - len(data))
        data += chunk
    request = runtime_pb2.ExpertRequest()
    request.ParseFromString(memoryview(data))
    return request, length


async def _answer_refusal(
    name: str,
    error: BaseException,
    lease: StreamLease,
    writer: asyncio.StreamWriter,
    on_reject: Callable[[str, BaseException], None],
    pace: MessagePace | None,
) -> None:
    """Counts a refused input, gives its bytes back, then tells the caller why."""
    on_reject(name, error)
    lease.release(lease.held)  # refused: its bytes are given back before the caller hears why
    with suppress(Exception):
        await send_message(RPCError(message=ls.error_text(error).decode()), writer, pace)


def cancelled_inside(error: asyncio.CancelledError) -> bool:
    """True where `error` came out of something the current task awaited (a future cancelled elsewhere) and not
    from a cancellation of the task itself (Python >= 3.11 counts those; on 3.10 every one is the task's)."""
    task = asyncio.current_task()
    cancelling = getattr(task, "cancelling", None)
    return cancelling is not None and cancelling() == 0


async def _answer_failure(
    name: str, error: asyncio.CancelledError, writer: asyncio.StreamWriter, pace: MessagePace | None
) -> None:
    """A method that failed with a cancellation of something it awaited: logged and answered as an error, so that
    the caller hears why instead of a stream closed without a reply."""
    logger.warning(f"stream_guard.method_cancelled(rpc={name}): {error!r:.200}")
    with suppress(Exception):
        await send_message(RPCError(message=f"{name} failed: an awaited operation was cancelled"), writer, pace)


def unanswered(name: str, context: P2PContext, reason: str, error: BaseException | None) -> None:
    """Logs a streamed request that ends without any reply from this server: such a stream reaches the caller as a
    connection closed without a reply. A caller that closed mid-request is routine (info); a reply that could not be
    sent, or a reader cancelled from elsewhere, is this side's (warning)."""
    level = logging.INFO if reason == "caller_closed" else logging.WARNING
    logger.log(level, f"stream_guard.unanswered(rpc={name}, peer=...{str(context.remote_id)[-6:]}, reason={reason}): "
                      f"{error!r:.200}")  # fmt: skip


StreamHandlerFn = Callable[[AsyncIterator[runtime_pb2.ExpertRequest], P2PContext], AsyncIterator[Any]]


def guarded_stream_handler(
    p2p: P2P,
    name: str,
    method: StreamHandlerFn,
    budget: StreamBudget,
    *,
    on_reject: Callable[[str, BaseException], None],
) -> Callable[..., Any]:
    """A binary stream handler serving `method` (an async-generator rpc: a forward or backward stream, its request
    gathered whole) with bounded reading: one reader task per stream reads ahead of the method, each message within
    the limits' pace. Its request's bytes stay charged to the peer's stream budget until the stream ends, its replies
    included: each reply must be taken within its pace (`send_message`), else what waits to go out is dropped and the
    stream cut (`ReplyStalled`, counted); the stream's socket is let go `CLOSE_FLUSH_S` after its close at the latest."""
    limits = budget.limits
    pace = limits.message_pace

    async def handle(stream_info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        context = P2PContext(handle_name=name, local_id=p2p.peer_id, remote_id=stream_info.peer_id)
        lease = StreamLease(budget, peer_key(context))
        read_deadlines = TaskDeadline()  # the reader task's deadlines: one lazily moved timer for the stream
        queue: asyncio.Queue = asyncio.Queue(MAX_PREFETCH_MESSAGES)

        async def requests() -> AsyncIterator[runtime_pb2.ExpertRequest]:
            while True:
                request, _ = await queue.get()
                if request is None:
                    return
                yield request  # (its bytes stay charged until the stream ends: the method may hold them all)

        async def process() -> None:
            try:
                async for response in method(requests(), context):
                    try:
                        await send_message(response, writer, pace)
                    except ReplyStalled as e:  # the caller does not take its replies: nothing more is said to it
                        on_reject(name, e)
                        writer.transport.abort()  # what waits to go out is dropped, the socket let go
                        return
                    except Exception as e:
                        unanswered(name, context, "send_failed", e)
                        return
            except asyncio.CancelledError as e:
                if not cancelled_inside(e):
                    raise  # the stream is over (the handler cancels its processing): nobody to answer
                await _answer_failure(name, e, writer, pace)
            except Exception as e:
                with suppress(Exception):
                    await send_message(RPCError(message=ls.error_text(e).decode()), writer, pace)

        async def receive() -> None:
            """The stream's one reader: messages into the queue until the end of the input (a task per stream,
            not per message). The request's parts share one pace clock, from the stream's start: the time the reader
            waits for room in the queue is the method's, not the caller's, and moves the clock on."""
            loop = asyncio.get_running_loop()
            since, received = loop.time(), 0
            while True:
                item = await read_message(
                    reader, lease, idle_s=limits.stream_idle_timeout_s, between_s=between_s, pace=pace, since=since,
                    before_bytes=received, deadlines=read_deadlines,
                )  # fmt: skip
                received += 1 + P2P.HEADER_LEN + item[1]
                waited = loop.time()
                await queue.put(item)
                since += loop.time() - waited
                if item[0] is None:
                    return

        async def finish_input() -> None:
            """Reads what is left of the caller's input (after a refusal, typically its end-of-stream marker) for at
            most FINISH_INPUT_S before the stream closes: a unix socket closed with unread bytes resets, and p2pd
            may then drop the reply it has not delivered yet (the caller saw a broken pipe instead of the error)."""
            deadline = time.monotonic() + FINISH_INPUT_S
            while True:
                while not queue.empty():
                    queue.get_nowait()  # discarded: their bytes are given back when the lease closes
                remaining_s = deadline - time.monotonic()
                if receiving.done() or remaining_s <= 0:
                    return
                await asyncio.wait({receiving}, timeout=min(remaining_s, FINISH_INPUT_POLL_S))

        between_s = limits.stream_idle_timeout_s  # a streamed request's parts come back to back
        processing = asyncio.create_task(process())
        receiving = asyncio.create_task(receive())
        try:
            await asyncio.wait({processing, receiving}, return_when=asyncio.FIRST_COMPLETED)
            if processing.done():  # the reply is complete (or failed and was answered)
                await finish_input()
                return
            if receiving.cancelled():
                unanswered(name, context, "reader_cancelled", None)
                return
            error = receiving.exception()
            if error is None:  # the end of the input is queued: the method finishes its replies
                await processing
                return
            if isinstance(error, (asyncio.IncompleteReadError, ConnectionError)):
                unanswered(name, context, "caller_closed", error)
                return  # the caller closed or died mid-request: processing is cancelled below
            if not isinstance(error, STREAM_REFUSALS):
                raise error
            processing.cancel()
            with suppress(asyncio.CancelledError, Exception):
                await processing
            await _answer_refusal(name, error, lease, writer, on_reject, pace)
        finally:
            processing.cancel()
            receiving.cancel()
            while not queue.empty():
                queue.get_nowait()
            lease.close()
            with suppress(asyncio.CancelledError, Exception):
                await receiving
            read_deadlines.close()
            with suppress(Exception):
                close_transport(writer.transport)

    return handle


StepsFn = Callable[[AsyncIterator[runtime_pb2.ExpertRequest], P2PContext, StepPort], Awaitable[None]]


def steps_handler(
    p2p: P2P, name: str, serve: StepsFn, budget: StreamBudget, *, on_reject: Callable[[str, BaseException], None]
) -> Callable[..., Any]:
    """A binary stream handler for `rpc_inference`'s p2p streams: the stream's connection taken from hivemind's reader
    (`FrameConnection.take_over`, `PeerFrames`) and served by `serve` (the handler's `serve_steps`) through a
    `PeerStreamPort`, so that its steps run by callbacks as the socket's do (no task and no await per step), under the
    same bounds as the other streams (each message charged before its body is buffered, `stream_idle_timeout_s` inside
    a message). A refused input is answered once the session is over (counted, its bytes given back, the error sent);
    the session's own error is sent as an `RPCError`; the rest of a caller's input is read before the stream closes, as
    `finish_input`; a caller that closed or died gets nothing. A peer holding `max_opening_streams_per_peer` streams
    whose sessions are not open yet has a new one refused at once (`OpeningStreams`), answered as a refused input."""
    idle_s = budget.limits.stream_idle_timeout_s or None
    opening = OpeningStreams(budget.limits)

    async def handle(stream_info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        context = P2PContext(handle_name=name, local_id=p2p.peer_id, remote_id=stream_info.peer_id)
        peer = peer_key(context)
        lease = StreamLease(budget, peer)
        conn = FrameConnection.take_over(
            reader, writer, header_bytes=PeerFrames.header_bytes, parse_header=PeerFrames.parse_header
        )
        codec = PeerFrames()
        timeline = step_timeline.open_stream()  # None unless the bench asked for step timelines (as the socket's)
        port = PeerStreamPort(
            conn, codec, sys.maxsize, lease=lease, idle_s=idle_s, timeline=timeline, pace=budget.limits.message_pace
        )
        failure: Exception | None = None
        try:
            opening.enter(peer)
        except PeerLimitExceeded as e:
            port.refused = e  # (its input is still read, and dropped, before the close)
        else:
            port.on_open = functools.partial(opening.leave, peer)
        try:
            try:
                if port.refused is None:
                    await serve(port.requests(), context, port)
            except Exception as e:
                failure = e
            port.detach()
            if port.broken or conn.lost:
                return  # the caller closed or died
            error: BaseException | None = failure
            if port.refused is not None:
                on_reject(name, port.refused)
                lease.release(lease.held)  # refused: its bytes are given back before the caller hears why
                error = port.refused
            if error is not None:
                conn.writelines(codec.encode(ls.ERROR, ls.error_text(error)))
                with suppress(asyncio.TimeoutError, Exception):  # (a caller that does not read is not waited for)
                    await asyncio.wait_for(conn.drain(), FINISH_INPUT_S)
            if not port.input_over:
                await port.drop_rest(FINISH_INPUT_S)
        finally:
            if port.on_open is not None:  # the stream ended before its session opened
                port.on_open()
            port.detach()
            lease.close()
            conn.close()
            step_timeline.close_stream(timeline)

    return handle


async def register_handlers(
    servicer: Any, p2p: P2P, budget: StreamBudget, on_reject: Any, *, balanced: bool = False
) -> list[str]:
    """Registers the servicer's rpcs on `p2p` like hivemind's `ServicerBase.add_p2p_handlers`, with every
    stream-input rpc read under bounds: `rpc_inference` through `steps_handler` and the servicer's `serve_steps`,
    the others through `guarded_stream_handler` (`balanced`: shared with other processes' registrations of the same
    names). Returns the names of the guarded handles."""
    servicer._collect_rpc_handlers()
    guarded: list[str] = []
    calls = []
    for handler in servicer._rpc_handlers:
        handle_name = servicer._get_handle_name(None, handler.method_name)
        method = getattr(servicer, handler.method_name)
        if handler.stream_input and handler.stream_output:
            if handler.method_name in STEP_RPCS:
                serve = getattr(servicer, "serve_steps", None)
                if serve is None:
                    continue  # a servicer that serves no inference streams (a bench's stand-in) registers none
                stream_handle = steps_handler(p2p, handle_name, serve, budget, on_reject=on_reject)
            else:
                stream_handle = guarded_stream_handler(p2p, handle_name, method, budget, on_reject=on_reject)
            calls.append(p2p.add_binary_stream_handler(handle_name, stream_handle, balanced=balanced))
            guarded.append(handle_name)
        else:
            calls.append(
                p2p.add_protobuf_handler(
                    handle_name,
                    method,
                    handler.request_type,
                    stream_input=handler.stream_input,
                    stream_output=handler.stream_output,
                    balanced=balanced,
                )
            )
    await asyncio.gather(*calls)
    logger.debug(f"stream_guard.registered(guarded={len(guarded)}, at={time.monotonic():.0f})")
    return guarded
