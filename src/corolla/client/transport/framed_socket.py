"""`FramedSocketStream`: an `rpc_inference` stream on a raw non-blocking socket, whose async methods run on the
client loop and whose sync `exchange` runs a whole step (send, wait, parse) in any one thread, so that a step costs
no hop to the loop thread and back (each hop is an idle thread's wake-up). Subclasses give the framing: the
same-host server socket (`local_transport.LocalInferenceStream`) and a p2pd stream (`p2p_stream.P2PInferenceStream`).
Every frame's length is checked against a limit before the buffer grows for it: the caller's (what its request
implies, `output_checks.reply_limit_bytes`), never above `MAX_RESPONSE_FRAME_BYTES`."""

from __future__ import annotations

import asyncio
import select
import socket
import time
from abc import ABC, abstractmethod
from typing import Protocol

from hivemind.proto import runtime_pb2

from corolla.protocol import local_stream as ls
from corolla.utils.interrupts import WAIT_SLICE_S

MAX_RESPONSE_FRAME_BYTES = 1 << 30  # a 2048-token bf16 prefill at hidden 16384 is 64 MiB: far below
RECV_BYTES = 1 << 16


class ReplyWaiter(Protocol):
    """What `exchange` asks while it waits (a span session's step: `client.session.step_wait`): the time to wake at
    the latest (`now_s` or later), `woke` after each sleep (asked to end at `asked_s`), `idle` at a wake without the
    response (does what is due; raises to end the wait)."""

    def wake_at(self, now_s: float) -> float: ...

    def woke(self, asked_s: float, now_s: float) -> object: ...

    def idle(self) -> None: ...


class FramedSocketStream(ABC):
    """One `rpc_inference` stream. Not thread-safe: one caller at a time, either the client loop (`send`,
    `receive`) or one thread (`exchange`)."""

    header_bytes = ls.HEADER_BYTES  # of every frame's header (the local and direct framing; p2pd's has its own)

    def __init__(self, sock: socket.socket, peer_id: str, rpc: str = "rpc_inference"):
        self.sock, self.peer_id, self.rpc = sock, peer_id, rpc  # rpc: the one it opened
        self._buffer = bytearray()
        self.closed = False
        self.polled_responses = 0  # `exchange` responses that arrived while it polled (no sleep, no wake-up)
        self._readable: select.poll | None = None  # `exchange`'s poll(2) object for this socket, made once

    # ---- framing (subclasses)

    @abstractmethod
    def _request_frame(self, payload: bytes) -> bytes:
        """The bytes of one request, serialized as `payload`."""

    @abstractmethod
    def _end_frame(self) -> bytes:
        """The bytes that end our side of the stream."""

    @abstractmethod
    def _header(self, buffer: bytearray, max_payload_bytes: int) -> tuple[int, int]:
        """(kind, payload length) of the frame at the start of `buffer` (which holds at least `header_bytes`);
        ValueError for a frame no honest server sends or one over its limit."""

    @abstractmethod
    def _response(self, kind: int, payload: bytes) -> runtime_pb2.ExpertResponse | None:
        """The response of one frame; None for the end of the stream; P2PHandlerError for the server's error."""

    # ---- async side (client loop)

    async def send(self, request: runtime_pb2.ExpertRequest) -> None:
        await asyncio.get_running_loop().sock_sendall(self.sock, self._request_frame(request.SerializeToString()))

    async def send_end(self) -> None:
        await asyncio.get_running_loop().sock_sendall(self.sock, self._end_frame())

    async def receive(self, max_bytes: int = MAX_RESPONSE_FRAME_BYTES) -> runtime_pb2.ExpertResponse | None:
        """The next response (ConnectionError once its frame announces more than `max_bytes`); None once the server
        ended the stream (or went away)."""
        try:
            kind, payload = await self.receive_frame(min(max_bytes, MAX_RESPONSE_FRAME_BYTES))
        except (EOFError, ConnectionResetError, BrokenPipeError):
            return None
        return self._response(kind, payload)

    async def receive_frame(self, max_payload_bytes: int) -> tuple[int, bytes]:
        loop = asyncio.get_running_loop()
        while (parsed := self._parse_frame(max_payload_bytes)) is None:
            chunk = await loop.sock_recv(self.sock, RECV_BYTES)
            if not chunk:
                raise EOFError("the server closed the stream")
            self._buffer += chunk
        return parsed

    # ---- sync side (any one thread)

    def exchange(
        self,
        request: runtime_pb2.ExpertRequest | bytes,
        *,
        timeout_s: float,
        poll_s: float = 0.0,
        max_response_bytes: int = MAX_RESPONSE_FRAME_BYTES,
        waiter: ReplyWaiter | None = None,
    ) -> runtime_pb2.ExpertResponse:
        """Sends `request` (a message, or its serialized bytes) and waits for its response in the calling thread:
        polling for up to `poll_s`, else sleeping in `poll(2)` before each read (a read that finds nothing costs a
        raised BlockingIOError) until `waiter.wake_at()` at the latest, then telling `waiter.woke` and, without the
        response, `waiter.idle()` (which may end the wait: it raises). ConnectionError when the stream ends or breaks
        or the response's frame announces more than `max_response_bytes`, TimeoutError past `timeout_s` without a
        `waiter` (a waiter's policy ends its wait, sending and receiving: it is the step's clock, which does not
        charge the server for the caller's own pauses)."""
        max_response_bytes = min(max_response_bytes, MAX_RESPONSE_FRAME_BYTES)
        start = time.monotonic()
        deadline = start + timeout_s
        data = memoryview(self._request_frame(request if isinstance(request, bytes) else request.SerializeToString()))
        while data:
            try:
                data = data[self.sock.send(data) :]
            except BlockingIOError:
                writable = select.poll()
                writable.register(self.sock, select.POLLOUT)
                while True:  # a server that leaves a long request unread holds the step as one holding its reply
                    now = time.monotonic()  # does: the waiter's policy ends both waits (decision 0245)
                    asked = max(now, min(deadline if waiter is None else waiter.wake_at(now), now + WAIT_SLICE_S))
                    ready = writable.poll((asked - now) * 1000)  # in slices: Ctrl-C ends the wait (utils.interrupts)
                    now = time.monotonic()
                    if waiter is not None:
                        waiter.woke(asked, now)
                    if ready:
                        break
                    if waiter is not None:
                        waiter.idle()
                    elif now >= deadline:
                        raise TimeoutError(f"stream to ...{self.peer_id[-6:]}: send timed out") from None
        poll_until = time.monotonic() + poll_s  # not polling (poll_s 0): sleep before each read, the reply is not there
        poller = self._readable
        if poller is None:
            poller = self._readable = select.poll()
            poller.register(self.sock, select.POLLIN)
        slept = False
        while (parsed := self._parse_frame(max_response_bytes)) is None:
            now = time.monotonic()
            if now >= poll_until:  # in slices: Ctrl-C ends the wait (utils.interrupts)
                asked = max(now, min(deadline if waiter is None else waiter.wake_at(now), now + WAIT_SLICE_S))
                poller.poll((asked - now) * 1000)
                slept, now = True, time.monotonic()
            else:
                asked = now  # (polling: no time asked for, none credited)
            if waiter is not None:
                waiter.woke(asked, now)
            try:
                chunk = self.sock.recv(RECV_BYTES)
            except BlockingIOError:
                if waiter is not None:
                    waiter.idle()
                elif now >= deadline:
                    raise TimeoutError(f"no response from ...{self.peer_id[-6:]} within {timeout_s} s") from None
                continue
            if not chunk:
                raise ConnectionError(f"server ...{self.peer_id[-6:]} closed the inference stream")
            self._buffer += chunk
        if poll_s > 0 and not slept:
            self.polled_responses += 1
        response = self._response(*parsed)
        if response is None:
            raise ConnectionError(f"server ...{self.peer_id[-6:]} ended the inference stream")
        return response

    # ---- both

    def _parse_frame(self, max_payload_bytes: int) -> tuple[int, bytes] | None:
        buffer = self._buffer
        if len(buffer) < self.header_bytes:
            return None
        try:
            kind, length = self._header(buffer, max_payload_bytes)
        except ValueError as e:  # the server broke the framing: this stream is unusable
            raise ConnectionError(f"stream from ...{self.peer_id[-6:]}: {e}") from None
        end = self.header_bytes + length
        if len(buffer) < end:
            return None
        with memoryview(buffer) as view:
            payload = bytes(view[self.header_bytes : end])
        del buffer[:end]
        return kind, payload

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.sock.close()
