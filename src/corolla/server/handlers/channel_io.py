"""Frame I/O for the device side of a handler channel (`device_channel`): the one intake thread (`channel_intake`)
receives each channel's frames with non-blocking `recv_into`s into one reused buffer per channel when its socket is
readable, and any thread (the event loop, the runtime's device thread) sends whole frames with `sendall` under one
lock (the GIL is released in the syscall).

Reads take whatever the socket holds (up to the buffer's free space), so frames that arrived together are parsed
out of one `recv_into` (each syscall also gives up and retakes the GIL). The header is checked (kind, length against
`max_frame_bytes`) before the buffer grows; the buffer only ever grows to the largest frame seen plus a header, never
past the bound. A payload view is valid until the next `receive`: the caller parses (copies) what it keeps before
it reads again."""

from __future__ import annotations

import socket
import threading

from corolla.server.handlers import proxy_wire as wire
from corolla.utils.logging import get_logger

logger = get_logger(__name__)

INITIAL_BUFFER_BYTES = 1 << 16


class FrameSocket:
    """One end of a stream socket carrying `proxy_wire` frames (see the module docstring). Use as a context
    manager: leaving it closes the socket (its reader then sees the end)."""

    def __init__(self, sock: socket.socket, max_frame_bytes: int):
        if max_frame_bytes < 1:
            raise ValueError(f"max_frame_bytes must be >= 1, got {max_frame_bytes}")
        sock.setblocking(True)
        self.sock = sock
        self.max_frame_bytes = max_frame_bytes
        self._buffer = bytearray(min(INITIAL_BUFFER_BYTES, max_frame_bytes))
        self._start = 0  # received bytes not parsed yet: self._buffer[self._start : self._end]
        self._end = 0
        self._send_lock = threading.Lock()
        self._closed = False
        self.frames_sent = 0  # counted under the send lock

    @property
    def closed(self) -> bool:
        return self._closed

    def _header(self) -> tuple[int, int, int] | None:
        """(length, kind, request id) of the next frame if its header is buffered, checked against the bounds
        (FrameError: an unknown kind, or a length over `max_frame_bytes`, before anything is allocated for it)."""
        if self._end - self._start < wire.HEADER_BYTES:
            return None
        length, kind, request_id = wire.HEADER.unpack_from(self._buffer, self._start)
        if kind not in wire.FRAME_KINDS:
            raise wire.FrameError(f"unknown frame kind {kind}")
        if length > self.max_frame_bytes:
            raise wire.FrameError(f"frame of {length} bytes exceeds max_frame_bytes={self.max_frame_bytes}")
        return length, kind, request_id

    def next_frame(self) -> tuple[int, int, memoryview] | None:
        """(kind, request id, payload view) of the next whole buffered frame, or None until `receive` brought it.
        The view is valid until the next `receive`. FrameError past the bounds."""
        header = self._header()
        if header is None:
            return None
        length, kind, request_id = header
        start = self._start + wire.HEADER_BYTES
        if self._end - start < length:
            return None
        self._start = start + length
        return kind, request_id, memoryview(self._buffer)[start : start + length]

    def receive(self, *, block: bool) -> int:
        """One `recv_into` of whatever the socket holds, after making room for the whole next frame (compacting, or
        growing the buffer to it: never past the bound); `block=False` returns 0 at once when nothing is waiting.
        Receives nothing (0) while a whole frame is buffered: `next_frame` first. ChannelClosed at the end."""
        header = self._header()
        count = wire.HEADER_BYTES if header is None else wire.HEADER_BYTES + header[0]
        pending = self._end - self._start
        if pending >= count:
            return 0
        if pending == 0:  # everything parsed: start over at the front, nothing to move
            self._start = self._end = 0
        if self._start + count > len(self._buffer):
            if count > len(self._buffer):
                grown = bytearray(count)  # a new buffer: an earlier payload view may still hold the old one
                grown[:pending] = self._buffer[self._start : self._end]
                self._buffer = grown
            else:
                self._buffer[:pending] = self._buffer[self._start : self._end]  # same size: no resize
            self._start, self._end = 0, pending
        try:
            n = self.sock.recv_into(memoryview(self._buffer)[self._end :], 0, 0 if block else socket.MSG_DONTWAIT)
        except BlockingIOError:
            return 0
        except OSError as e:
            raise wire.ChannelClosed(f"handler channel closed: {e!r}") from e
        if n == 0:
            raise wire.ChannelClosed("handler channel closed")
        self._end += n
        return n

    def send_frames(self, frames: list[bytes]) -> bool:
        """Sends whole frames in order (never interleaved with another thread's); False if the socket is closed or
        the other end is gone (the reader sees that end and ends the channel)."""
        with self._send_lock:
            if self._closed:
                return False
            try:
                for frame in frames:
                    self.sock.sendall(frame)
                    self.frames_sent += 1
            except OSError as e:
                logger.debug(f"channel_io.send_failed(error={e!r})")
                return False
        return True

    def shutdown(self) -> None:
        """Ends both directions: its reader (`receive`) sees the end (ChannelClosed), and so does the other end."""
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass  # already gone

    def close(self) -> None:
        self.shutdown()
        with self._send_lock:
            self._closed = True
            self.sock.close()

    def __enter__(self) -> FrameSocket:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
