"""Bounded reading of streamed RPCs (`rpc_*_stream`, `rpc_inference`): the same wire framing as hivemind's
protobuf stream handler (marker byte, 8-byte length, message; an error marker ends the input), but a message's
declared length is checked and charged to per-stream, per-peer and global byte budgets BEFORE its bytes are read,
a peer that stops sending mid-message (or between the parts of a forward stream) is cut off after
`stream_idle_timeout_s`, and every charged byte is given back when the message is processed or the stream ends."""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import gc
import logging
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Callable
from contextlib import suppress
from typing import Any

from hivemind.p2p import P2P, P2PContext
from hivemind.proto import runtime_pb2
from hivemind.proto.p2pd_pb2 import RPCError

from corolla.protocol.stream_frames import ERROR_MARKER, MESSAGE_MARKER, frame_header
from corolla.server.core.limits import MiB, PeerLimitExceeded, PeerLimits, ServerLimitExceeded, StreamStalled, peer_key
from corolla.utils.deadlines import TASK_DEADLINES, TaskDeadline
from corolla.utils.logging import get_logger

logger = get_logger(__name__)

READ_CHUNK_BYTES = 1 * MiB
MAX_PREFETCH_MESSAGES = 5  # as hivemind's handler: messages read ahead of the one being processed
TRIM_AFTER_BYTES = 16 * MiB  # give freed stream buffers back to the OS (glibc keeps them otherwise)
TRIM_DELAY_S = 0.5
# streams whose handler reads one message at a time, each governed by the handler's own step timeout
PER_MESSAGE_RPCS = ("rpc_inference",)
FINISH_INPUT_S = 1.0  # after the reply: how long the rest of a caller's input is read (and dropped) before closing
FINISH_INPUT_POLL_S = 0.01  # how often the dropped messages are taken off the full read-ahead queue meanwhile


class StreamBudget:
    """Bytes of streamed requests received and not yet processed: per peer and in total (event loop only)."""

    def __init__(self, limits: PeerLimits):
        self.limits = limits
        self.total_bytes = 0
        self.per_peer: dict[str, int] = defaultdict(int)
        self._freed_since_trim = 0

    def charge(self, peer: str, nbytes: int) -> None:
        limits = self.limits
        if nbytes <= 0:
            return  # an empty message (e.g. the end of a session) holds nothing
        if limits.max_stream_message_bytes and nbytes > limits.max_stream_message_bytes:
            raise PeerLimitExceeded(
                f"stream message of {nbytes} bytes exceeds max_stream_message_bytes={limits.max_stream_message_bytes}",
                reason="stream_message_too_big",
            )
        held = self.per_peer.get(peer, 0)
        if limits.max_stream_bytes_per_peer and held + nbytes > limits.max_stream_bytes_per_peer:
            raise PeerLimitExceeded(
                f"stream message of {nbytes} bytes refused: this peer already has {held} bytes of unfinished "
                f"requests, the limit is max_stream_bytes_per_peer={limits.max_stream_bytes_per_peer}",
                reason="peer_stream_bytes",
            )
        if limits.max_stream_bytes_total and self.total_bytes + nbytes > limits.max_stream_bytes_total:
            raise ServerLimitExceeded(
                f"stream message of {nbytes} bytes refused: the server holds {self.total_bytes} bytes of unfinished "
                f"requests, the limit is max_stream_bytes_total={limits.max_stream_bytes_total}; retry later",
                reason="stream_bytes_full",
            )
        self.per_peer[peer] = held + nbytes
        self.total_bytes += nbytes

    def release(self, peer: str, nbytes: int) -> None:
        if nbytes <= 0:
            return
        left = self.per_peer.get(peer, 0) - nbytes
        assert left >= 0 and self.total_bytes >= nbytes, "stream budget released more than it charged"
        if left:
            self.per_peer[peer] = left
        else:
            self.per_peer.pop(peer, None)
        self.total_bytes -= nbytes
        self._freed_since_trim += nbytes

    def maybe_trim(self) -> None:
        """After large frees with nothing left in flight, asks glibc to return free heap pages to the OS."""
        if self._freed_since_trim >= TRIM_AFTER_BYTES and self.total_bytes == 0:
            self._freed_since_trim = 0
            gc.collect(1)  # a refused message's buffer may sit in an exception's traceback cycle
            malloc_trim()
            logger.debug("stream_guard.trimmed")


_libc: Any = None


def malloc_trim() -> bool:
    """`malloc_trim(0)` where the C library has it (glibc); False elsewhere."""
    global _libc
    if _libc is None:
        name = ctypes.util.find_library("c")
        try:
            _libc = ctypes.CDLL(name) if name else False
        except OSError:
            _libc = False
    trim = getattr(_libc, "malloc_trim", None) if _libc else None
    if trim is None:
        return False
    return bool(trim(0))


class StreamLease:
    """The bytes one stream holds in a `StreamBudget`; `close()` gives back whatever is left."""

    def __init__(self, budget: StreamBudget, peer: str):
        self.budget, self.peer, self.held = budget, peer, 0

    def charge(self, nbytes: int) -> None:
        self.budget.charge(self.peer, nbytes)
        self.held += nbytes

    def release(self, nbytes: int) -> None:
        nbytes = min(nbytes, self.held)
        self.held -= nbytes
        self.budget.release(self.peer, nbytes)

    def close(self) -> None:
        self.release(self.held)
        # trim once the stream's handler has unwound (its frames still hold the buffers now)
        asyncio.get_running_loop().call_later(TRIM_DELAY_S, self.budget.maybe_trim)


ONE_WRITE_MAX_BYTES = 1 * MiB  # a reply up to this size goes out in one write (one copy of its body)


async def send_message(message: runtime_pb2.ExpertResponse | RPCError, writer: asyncio.StreamWriter) -> None:
    """hivemind's framing (marker byte, 8-byte length, body), the bytes `P2P.send_protobuf` writes, but as one write
    where the body is small: one `send` and one wake-up of `p2pd` per reply instead of three."""
    body = message.SerializeToString()
    header = frame_header(ERROR_MARKER if isinstance(message, RPCError) else MESSAGE_MARKER, len(body))
    if len(body) <= ONE_WRITE_MAX_BYTES:
        writer.write(header + body)
    else:  # large forward/backward replies: no copy of the body
        writer.write(header)
        writer.write(body)
    await writer.drain()


async def within_idle(awaitable: Any, timeout_s: float | None, what: str) -> Any:
    """`awaitable` within `timeout_s` (None or 0: no limit), else StreamStalled naming `what` (Python 3.10's reads:
    a `wait_for` task each)."""
    if not timeout_s:
        return await awaitable
    try:
        return await asyncio.wait_for(awaitable, timeout_s)
    except asyncio.TimeoutError:
        raise StreamStalled(f"the peer sent nothing for stream_idle_timeout={timeout_s} s {what}") from None


async def _read_message(
    reader: asyncio.StreamReader,
    lease: StreamLease,
    *,
    idle_s: float,
    between_s: float | None,
    deadlines: TaskDeadline | None = None,
) -> tuple[runtime_pb2.ExpertRequest | None, int]:
    """One framed message (None at the end of the input) and the bytes it was charged. On Python >= 3.11 the
    deadlines of its reads (`between_s` for the marker, `idle_s` from the start of every later read) are one scope
    of the reading task's `TaskDeadline` (`deadlines`: one per stream, its timer moved lazily) instead of an
    `asyncio.wait_for` task per read."""
    if not TASK_DEADLINES:
        return await _read_message_tasks(reader, lease, idle_s=idle_s, between_s=between_s)
    if deadlines is None:
        deadlines = TaskDeadline()
    loop = deadlines.loop  # (the stream's loop: no get_running_loop, a getpid() syscall, per message)
    limit_s: float | None = between_s or None
    what = "between the parts of a streamed request"
    inside_s = idle_s or None
    try:
        with deadlines.scope(None if limit_s is None else loop.time() + limit_s) as scope:
            marker = await reader.readexactly(1)
            what, limit_s = "inside a message", inside_s
            scope.move(None if inside_s is None else loop.time() + inside_s)
            header = await reader.readexactly(P2P.HEADER_LEN)
            length = int.from_bytes(header, P2P.BYTEORDER)
            if marker == P2P.ERROR_MARKER:  # the caller's end-of-stream (or its error): small, read and ignore
                if length > 64 * 1024:
                    raise ValueError(f"end-of-stream message of {length} bytes is larger than 65536")
                scope.move(None if inside_s is None else loop.time() + inside_s)
                await reader.readexactly(length)
                return None, 0
            if marker != P2P.MESSAGE_MARKER:
                raise ValueError("invalid stream message marker")
            lease.charge(length)  # before a single byte of the body is buffered
            data: bytes | bytearray = b""
            if length:  # the usual step: its whole body in one read (what has arrived, at most `length`)
                scope.move(None if inside_s is None else loop.time() + inside_s)
                data = await reader.read(min(length, READ_CHUNK_BYTES))
                if not data:
                    raise asyncio.IncompleteReadError(b"", length)
            if len(data) < length:
                data = bytearray(data)  # grows only as bytes arrive (a declared length alone allocates nothing)
                while len(data) < length:
                    scope.move(None if inside_s is None else loop.time() + inside_s)
                    chunk = await reader.read(min(length - len(data), READ_CHUNK_BYTES))
                    if not chunk:
                        raise asyncio.IncompleteReadError(b"", length - len(data))
                    data += chunk
    except TimeoutError:
        if deadlines.expired:
            raise StreamStalled(f"the peer sent nothing for stream_idle_timeout={limit_s} s {what}") from None
        raise
    request = runtime_pb2.ExpertRequest()
    request.ParseFromString(memoryview(data))
    return request, length


async def _read_message_tasks(
    reader: asyncio.StreamReader, lease: StreamLease, *, idle_s: float, between_s: float | None
) -> tuple[runtime_pb2.ExpertRequest | None, int]:
    """`_read_message` on Python 3.10 (no `asyncio.timeout`): an `asyncio.wait_for` per bounded read."""
    marker = await within_idle(reader.readexactly(1), between_s, "between the parts of a streamed request")
    header = await within_idle(reader.readexactly(P2P.HEADER_LEN), idle_s, "inside a message")
    length = int.from_bytes(header, P2P.BYTEORDER)
    if marker == P2P.ERROR_MARKER:  # the caller's end-of-stream (or its error): small, read and ignore
        if length > 64 * 1024:
            raise ValueError(f"end-of-stream message of {length} bytes is larger than 65536")
        await within_idle(reader.readexactly(length), idle_s, "inside a message")
        return None, 0
    if marker != P2P.MESSAGE_MARKER:
        raise ValueError("invalid stream message marker")
    lease.charge(length)  # before a single byte of the body is buffered
    data = bytearray()  # grows only as bytes arrive (a declared length alone allocates nothing)
    while len(data) < length:
        chunk = await within_idle(reader.read(min(length - len(data), READ_CHUNK_BYTES)), idle_s, "inside a message")
        if not chunk:
            raise asyncio.IncompleteReadError(b"", length - len(data))
        data += chunk
    request = runtime_pb2.ExpertRequest()
    request.ParseFromString(memoryview(data))
    return request, length


_READ_REFUSALS = (PeerLimitExceeded, ServerLimitExceeded, StreamStalled, ValueError)  # a stream's input refused


async def _answer_refusal(
    name: str,
    error: BaseException,
    lease: StreamLease,
    writer: asyncio.StreamWriter,
    on_reject: Callable[[str, BaseException], None],
) -> None:
    """Counts a refused input, gives its bytes back, then tells the caller why."""
    on_reject(name, error)
    lease.release(lease.held)  # refused: its bytes are given back before the caller hears why
    with suppress(Exception):
        await send_message(RPCError(message=str(error)), writer)


def cancelled_inside(error: asyncio.CancelledError) -> bool:
    """True where `error` came out of something the current task awaited (a future cancelled elsewhere) and not
    from a cancellation of the task itself (Python >= 3.11 counts those; on 3.10 every one is the task's)."""
    task = asyncio.current_task()
    cancelling = getattr(task, "cancelling", None)
    return cancelling is not None and cancelling() == 0


async def _answer_failure(name: str, error: asyncio.CancelledError, writer: asyncio.StreamWriter) -> None:
    """A method that failed with a cancellation of something it awaited: logged and answered as an error, so that
    the caller hears why instead of a stream closed without a reply."""
    logger.warning(f"stream_guard.method_cancelled(rpc={name}): {error!r:.200}")
    with suppress(Exception):
        await send_message(RPCError(message=f"{name} failed: an awaited operation was cancelled"), writer)


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
    per_message: bool,
    on_reject: Callable[[str, BaseException], None],
) -> Callable[..., Any]:
    """A binary stream handler serving `method` (an async-generator rpc) with bounded reading. `per_message`: the
    method takes one message at a time (`rpc_inference`): its task reads each message itself (`_inline_handler`)."""
    if per_message:
        return _inline_handler(p2p, name, method, budget, on_reject=on_reject)
    limits = budget.limits

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
                        await send_message(response, writer)
                    except Exception as e:
                        unanswered(name, context, "send_failed", e)
                        return
            except asyncio.CancelledError as e:
                if not cancelled_inside(e):
                    raise  # the stream is over (the handler cancels its processing): nobody to answer
                await _answer_failure(name, e, writer)
            except Exception as e:
                with suppress(Exception):
                    await send_message(RPCError(message=str(e)), writer)

        async def receive() -> None:
            """The stream's one reader: messages into the queue until the end of the input (a task per stream,
            not per message)."""
            while True:
                item = await _read_message(
                    reader, lease, idle_s=limits.stream_idle_timeout_s, between_s=between_s, deadlines=read_deadlines
                )
                await queue.put(item)
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
            if not isinstance(error, _READ_REFUSALS):
                raise error
            processing.cancel()
            with suppress(asyncio.CancelledError, Exception):
                await processing
            await _answer_refusal(name, error, lease, writer, on_reject)
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
                writer.close()

    return handle


class _InlineInput:
    """A per-message stream's input, read by the task that asks for the next request: no reader task and no queue
    between them (one task wake-up and one loop iteration less per message). Each message is read under the same
    bounds as `receive`'s (charged before its body is read, `idle_s` inside it, its bytes given back once it is
    the method's); a refusal, the caller's end and a broken input end the requests and are kept for the handler,
    which answers them once the method is done."""

    def __init__(self, reader: asyncio.StreamReader, lease: StreamLease, idle_s: float):
        self.reader, self.lease, self.idle_s = reader, lease, idle_s
        self.deadlines = TaskDeadline()  # the reads' deadlines: one lazily moved timer for the stream
        self.ended = False  # the caller's end-of-stream was read, or its input failed
        self.broken = False  # the caller closed or died mid-message: nothing more to read or answer
        self.refused: BaseException | None = None  # a message over a limit, a stalled peer, a malformed frame

    async def requests(self) -> AsyncIterator[runtime_pb2.ExpertRequest]:
        while not self.ended:
            try:
                request, nbytes = await _read_message(
                    self.reader, self.lease, idle_s=self.idle_s, between_s=None, deadlines=self.deadlines
                )
            except (asyncio.IncompleteReadError, ConnectionError):
                self.ended = self.broken = True
                return
            except _READ_REFUSALS as e:
                self.ended, self.refused = True, e
                return
            if request is None:
                self.ended = True
                return
            self.lease.release(nbytes)  # processed one at a time: its bytes are the handler's now
            yield request

    async def drop_rest(self) -> None:
        """Reads (and drops) what is left of the input for at most FINISH_INPUT_S: see `finish_input`."""

        async def drop() -> None:
            async for _ in self.requests():
                pass

        with suppress(asyncio.TimeoutError, Exception):
            await asyncio.wait_for(drop(), FINISH_INPUT_S)


def _inline_handler(
    p2p: P2P,
    name: str,
    method: StreamHandlerFn,
    budget: StreamBudget,
    *,
    on_reject: Callable[[str, BaseException], None],
) -> Callable[..., Any]:
    """`guarded_stream_handler` for a per-message method: the method's task reads the messages (`_InlineInput`).
    Refusals are answered as there (counted, their bytes given back, the error sent), after the method has seen
    the end of its input; the rest of a caller's input is read before the stream closes, as `finish_input`."""
    idle_s = budget.limits.stream_idle_timeout_s

    async def handle(stream_info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        context = P2PContext(handle_name=name, local_id=p2p.peer_id, remote_id=stream_info.peer_id)
        lease = StreamLease(budget, peer_key(context))
        source = _InlineInput(reader, lease, idle_s)
        failure: Exception | None = None
        try:
            try:
                async for response in method(source.requests(), context):
                    try:
                        await send_message(response, writer)
                    except Exception:
                        logger.debug("stream_guard.send_failed", exc_info=True)
                        break
            except Exception as e:
                failure = e
            if source.broken:
                return  # the caller closed or died
            if source.refused is not None:
                await _answer_refusal(name, source.refused, lease, writer, on_reject)
                return
            if failure is not None:
                with suppress(Exception):
                    await send_message(RPCError(message=str(failure)), writer)
            if not source.ended:
                await source.drop_rest()
        finally:
            lease.close()
            source.deadlines.close()
            with suppress(Exception):
                writer.close()

    return handle


async def register_handlers(
    servicer: Any, p2p: P2P, budget: StreamBudget, on_reject: Any, *, balanced: bool = False
) -> list[str]:
    """Registers the servicer's rpcs on `p2p` like hivemind's `ServicerBase.add_p2p_handlers`, with every
    stream-input rpc read through `guarded_stream_handler` (`balanced`: shared with other processes' registrations
    of the same names). Returns the names of the guarded handles."""
    servicer._collect_rpc_handlers()
    guarded: list[str] = []
    calls = []
    for handler in servicer._rpc_handlers:
        handle_name = servicer._get_handle_name(None, handler.method_name)
        method = getattr(servicer, handler.method_name)
        if handler.stream_input and handler.stream_output:
            per_message = handler.method_name in PER_MESSAGE_RPCS
            stream_handle = guarded_stream_handler(
                p2p, handle_name, method, budget, per_message=per_message, on_reject=on_reject
            )
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
