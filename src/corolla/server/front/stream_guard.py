"""p2p's streamed RPCs (`rpc_*_stream`, `rpc_inference`) read under bounds: each stream's connection is taken from
hivemind's reader and read as the socket's are (hivemind's framing, `PeerFrames`): a message's declared length charged
to the stream byte budgets before its bytes are read, a peer that stops sending mid-message cut off after
`stream_idle_timeout_s`, every charged byte given back once processed. `register_handlers` registers them all."""

from __future__ import annotations

import asyncio
import functools
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import suppress
from typing import Any

from hivemind.p2p import P2P, P2PContext
from hivemind.proto import runtime_pb2

from corolla.protocol import local_stream as ls
from corolla.server.core.limits import (
    PeerLimitExceeded,
    ReplyStalled,
    peer_key,
)
from corolla.server.core.peer_bytes import StreamBudget
from corolla.server.front import step_timeline
from corolla.server.front.inference_stream import StepPort
from corolla.server.front.opening_streams import OpeningStreams
from corolla.server.front.stream_endpoint import (
    FrameConnection,
    PeerFrames,
    PeerStreamPort,
    drain_reply,
)
from corolla.utils.logging import get_logger

logger = get_logger(__name__)


# streams of steps, served by callbacks (`steps_handler`), each governed by the session's own step timeout
STEP_RPCS = ("rpc_inference",)
FINISH_INPUT_S = 1.0  # after the reply: how long the rest of a caller's input is read (and dropped) before closing


def cancelled_inside() -> bool:
    """True where the cancellation being handled came out of something the current task awaited (a future cancelled
    elsewhere), not from a cancellation of the task itself (Python >= 3.11 counts those; on 3.10 every one is the
    task's)."""
    task = asyncio.current_task()
    cancelling = getattr(task, "cancelling", None)
    return cancelling is not None and cancelling() == 0


def unanswered(name: str, context: P2PContext, error: BaseException | None) -> None:
    """Logs a streamed request that ends without any reply from this server because its caller closed or died
    mid-request (routine): such a stream reaches the caller as a connection closed without a reply."""
    logger.info(
        f"stream_guard.unanswered(rpc={name}, peer=...{str(context.remote_id)[-6:]}, reason=caller_closed): "
        f"{error!r:.200}"
    )


async def _answer(
    name: str, port: PeerStreamPort, error: BaseException | None, on_reject: Callable[[str, BaseException], None]
) -> None:
    """A p2p stream's last word: a refused input counted and answered alone (its bytes given back before the caller
    hears why), else `error`'s text (None: nothing to say); then the rest of the caller's input read and dropped for
    up to `FINISH_INPUT_S`."""
    if port.refused is not None:
        on_reject(name, port.refused)
        assert port.lease is not None
        port.lease.release(port.lease.held)
        error = port.refused
    if error is not None:
        port.conn.writelines(port.codec.encode(ls.ERROR, ls.error_text(error)))
        with suppress(asyncio.TimeoutError, Exception):  # (a caller that does not read is not waited for)
            await asyncio.wait_for(port.conn.drain(), FINISH_INPUT_S)
    if not port.input_over:
        await port.drop_rest(FINISH_INPUT_S)


StreamHandlerFn = Callable[[AsyncIterator[runtime_pb2.ExpertRequest], P2PContext], AsyncIterator[Any]]


class RequestPort(PeerStreamPort):
    """A p2p forward or backward stream's port: its request's parts read as the socket's front reads them
    (`SocketPort.requests(whole=True)`: one pace clock from the stream's start, every part charged until the stream
    ends), but an input that fails (refused, stalled, broken off) stops the method where it reads (`parts`) and is
    kept in `read_error`: the method never computes on part of a request, and its own error handling never sees it."""

    read_error: Exception | None = None

    def _input_failed(self, error: Exception) -> bool:
        super()._input_failed(error)  # `broken` or `refused` (the input is over) where it is one of those
        self.read_error = error
        return False

    async def parts(self) -> AsyncIterator[runtime_pb2.ExpertRequest]:
        try:
            async for request in self.requests(whole=True):
                yield request
        except Exception:
            raise asyncio.CancelledError from None  # `read_error` says why


def guarded_stream_handler(
    p2p: P2P,
    name: str,
    method: StreamHandlerFn,
    budget: StreamBudget,
    *,
    on_reject: Callable[[str, BaseException], None],
) -> Callable[..., Any]:
    """A binary stream handler serving `method` (an async-generator rpc: a forward or backward stream, its request
    gathered whole) over the stream's connection taken from hivemind's reader and read as the socket's are
    (`RequestPort`); each reply taken within its pace (`drain_reply`), else the stream is cut (`ReplyStalled`,
    counted). A caller that closed or died gets nothing; any other ends with `_answer`."""
    limits = budget.limits
    idle_s, pace = limits.stream_idle_timeout_s or None, limits.message_pace

    async def handle(stream_info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        context = P2PContext(handle_name=name, local_id=p2p.peer_id, remote_id=stream_info.peer_id)
        lease = budget.lease(peer_key(context))
        conn = FrameConnection.take_over(
            reader, writer, header_bytes=PeerFrames.header_bytes, parse_header=PeerFrames.parse_header
        )
        port = RequestPort(conn, PeerFrames(), sys.maxsize, lease=lease, idle_s=idle_s, timeline=None, pace=pace)
        error: BaseException | None = None
        try:
            try:
                async for response in method(port.parts(), context):
                    port.reply(response)
                    await drain_reply(conn.drain(), response.ByteSize(), pace)
            except ReplyStalled as e:  # the caller does not take its replies: nothing more is said to it
                on_reject(name, e)
                if conn.transport is not None:
                    conn.transport.abort()
                return
            except asyncio.CancelledError as e:
                if port.read_error is None and not cancelled_inside():
                    raise  # the stream is over (the handler cancels its processing): nobody to answer
                if port.read_error is None:  # a cancellation out of something the method awaited: a failure
                    logger.warning(f"stream_guard.method_cancelled(rpc={name}): {e!r:.200}")
                    error = RuntimeError(f"{name} failed: an awaited operation was cancelled")
            except Exception as e:
                error = e
            if port.broken or conn.lost:
                unanswered(name, context, port.read_error or error)
                return
            if port.read_error is not None and port.refused is None:
                raise port.read_error
            await _answer(name, port, error, on_reject)
        finally:
            port.detach()
            lease.close()
            conn.close()

    return handle


StepsFn = Callable[[AsyncIterator[runtime_pb2.ExpertRequest], P2PContext, StepPort], Awaitable[None]]


def steps_handler(
    p2p: P2P, name: str, serve: StepsFn, budget: StreamBudget, *, on_reject: Callable[[str, BaseException], None]
) -> Callable[..., Any]:
    """A binary stream handler for `rpc_inference`'s p2p streams, as `guarded_stream_handler` serves the others (same
    bounds, answers and close), its steps run by `serve` (the handler's `serve_steps`) through a `PeerStreamPort`:
    by callbacks, as the socket's (no task and no await per step). A refused input is answered once the session is
    over. A peer holding `max_opening_streams_per_peer` streams whose sessions are not open yet has a new one
    refused at once (`OpeningStreams`)."""
    idle_s = budget.limits.stream_idle_timeout_s or None
    opening = OpeningStreams(budget.limits)

    async def handle(stream_info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        context = P2PContext(handle_name=name, local_id=p2p.peer_id, remote_id=stream_info.peer_id)
        peer = peer_key(context)
        lease = budget.lease(peer)
        conn = FrameConnection.take_over(
            reader, writer, header_bytes=PeerFrames.header_bytes, parse_header=PeerFrames.parse_header
        )
        timeline = step_timeline.open_stream()  # None unless the bench asked for step timelines (as the socket's)
        port = PeerStreamPort(
            conn, PeerFrames(), sys.maxsize, lease=lease, idle_s=idle_s, timeline=timeline,
            pace=budget.limits.message_pace,
        )  # fmt: skip
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
            await _answer(name, port, failure, on_reject)
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
