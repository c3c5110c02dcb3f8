"""`FrameConnection`: one connection of the same-host socket or the direct port as an asyncio `Protocol` that hands
out whole frames (`protocol.local_stream` framing), in place of a `StreamReader`/`StreamWriter` pair.

A frame is taken whole once its bytes are buffered (`take_frame`: one header parse and one slice), either by a task
(`read_frame`: it waits once for the bytes the frame still needs, where a `StreamReader` wakes its reader per chunk
and reads a frame in two awaited calls) or by a callback (`deliver`: told when bytes or the end of the input arrive,
no task woken: an inference stream's steps). A declared length is checked, and charged where asked, when its header
is parsed, before the payload is waited for. A payload that stops arriving for `idle_s` ends the stream
(`StreamStalled`): one timer per wait, re-armed from the last byte's arrival when it fires early, not moved per
chunk. Reading pauses while more than `2 * limit_bytes` wait unread and nothing waits for them, as a `StreamReader`
with that limit does; writing follows the transport's flow control (`drain`, `writing_paused`, `on_writable`)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any

from corolla.protocol import local_stream as ls
from corolla.server.core.limits import StreamStalled

DEFAULT_LIMIT_BYTES = 1 << 16
INSIDE_A_MESSAGE = "inside a message"


class FrameConnection(asyncio.Protocol):
    """See the module docstring. `serve`, where given, runs as the connection's task once the transport is made (a
    listener's protocol factory)."""

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
