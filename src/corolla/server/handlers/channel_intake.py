"""One thread reads every handler channel of the device process (`device_channel`): a selector over the channels'
sockets; a readable channel's bytes are received without blocking (`FrameSocket.receive`) and each whole
frame is handed to its channel (`FrameSource.on_frame`: steps straight to the runtime, the rest to the event loop).

Why one thread and not one per channel: every Python thread of the device process competes with the runtime thread
for the GIL, and the runtime thread retakes it after each device wait. With a reader thread per handler process,
each wait could end behind several readers' bursts (the GIL is not handed over in order), and the merged forward
grew with the number of handler processes (H100, 64 sessions, clients on other CPUs: 1.76 ms with 2 handler
processes, 2.47 with 4, 3.77 with 8; aggregate 8037 / 6741 / 4946 tok/s). One intake thread is one competitor,
whatever the number of handler processes, and it reads every channel that became readable in one pass.

A channel ends (`FrameSource.on_end`) when its socket ends, when a frame breaks the wire's bounds (FrameError), or
when the intake closes; it is then unregistered and never called again. Channels are added from any thread: the
intake thread applies additions between selects (woken through a socket pair), so the selector is only ever touched
by its own thread.

Frame I/O (`FrameSocket`, one per channel): the intake receives each channel's frames with non-blocking `recv_into`s
into one reused buffer per channel when its socket is readable, and any thread (the event loop, the runtime's device
thread) sends whole frames with `sendall` under one lock (the GIL is released in the syscall). Reads take whatever
the socket holds (up to the buffer's free space), so frames that arrived together are parsed out of one `recv_into`
(each syscall also gives up and retakes the GIL). The header is checked (kind, length against `max_frame_bytes`)
before the buffer grows; the buffer only ever grows to the largest frame seen plus a header, never past the bound. A
payload view is valid until the next `receive`: the caller parses (copies) what it keeps before it reads again."""

from __future__ import annotations

import selectors
import socket
import threading
from typing import Protocol

from corolla.protocol import channel_frames as wire
from corolla.utils.logging import get_logger

logger = get_logger(__name__)

INITIAL_BUFFER_BYTES = 1 << 16


class FrameSocket:
    """One end of a stream socket carrying `protocol.channel_frames` frames (see the module docstring). Use as a context
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
                logger.debug(f"channel_intake.send_failed(error={e!r})")
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


THREAD_NAME = "corolla-channel-intake"  # "corolla-channel-" like the writer threads: benches sum them by prefix


class FrameSource(Protocol):
    """A channel the intake reads for: its socket, what to do with each frame, and its end."""

    io: FrameSocket

    def on_frame(self, kind: int, request_id: int, payload: memoryview) -> None:
        """One whole frame, in the intake thread; the view is valid until this returns. Raising ends the channel."""
        ...

    def on_end(self, error: BaseException | None) -> None:
        """The channel ended (None: its socket closed or the intake stopped); called once, in the intake thread."""
        ...


class ChannelIntake:
    """The device process's one reader of handler channels (see the module docstring). Use as a context manager,
    or `close()`: the thread ends and every channel still registered ends with it."""

    def __init__(self, name: str = THREAD_NAME):
        self.name = name
        self._lock = threading.Lock()
        self._adding: list[FrameSource] = []
        self._closing = False
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._thread: threading.Thread | None = None
        self.num_frames = 0  # counted by the intake thread

    def add(self, source: FrameSource) -> None:
        """Reads `source`'s frames from now on (the thread starts with the first channel); RuntimeError once
        closed."""
        with self._lock:
            if self._closing:
                raise RuntimeError("ChannelIntake is closed")
            self._adding.append(source)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
                self._thread.start()
        self._wake()

    def close(self, timeout_s: float = 10.0) -> None:
        """Ends the thread (after the frame it is handling) and every channel still registered."""
        with self._lock:
            self._closing = True
            thread = self._thread
        self._wake()
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout_s)
            if thread.is_alive():
                logger.warning(f"channel_intake.close: thread still busy after {timeout_s} s")
                return
        for end in (self._wake_r, self._wake_w):
            end.close()

    def __enter__(self) -> ChannelIntake:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"\0")
        except (BlockingIOError, OSError):
            pass  # a wake-up is pending already, or the intake closed

    def _run(self) -> None:
        selector = selectors.DefaultSelector()
        selector.register(self._wake_r, selectors.EVENT_READ, None)
        try:
            while True:
                for key, _ in selector.select():
                    source: FrameSource | None = key.data
                    if source is None:
                        if not self._take_additions(selector):
                            return
                        continue
                    self._read(selector, source)
        except Exception as e:  # a bug here would silence every channel: end them all, loudly
            logger.error(f"channel_intake.failed(error={e!r})")
        finally:
            with self._lock:  # no channel is added to a thread that is gone (`add` raises: the pool fails over)
                self._closing = True
                orphans, self._adding = self._adding, []
            for source in orphans:
                source.on_end(None)
            for key in list(selector.get_map().values()):
                if key.data is not None:
                    self._end(selector, key.data, None)
            selector.close()

    def _take_additions(self, selector: selectors.BaseSelector) -> bool:
        """Registers the channels added meanwhile; False once the intake is closing."""
        try:
            while self._wake_r.recv(4096):
                pass
        except BlockingIOError:
            pass
        with self._lock:
            adding, self._adding = self._adding, []
            closing = self._closing
        for source in adding:
            try:
                selector.register(source.io.sock, selectors.EVENT_READ, source)
            except (OSError, ValueError) as e:  # closed before it could be read
                source.on_end(e)
        return not closing

    def _read(self, selector: selectors.BaseSelector, source: FrameSource) -> None:
        """One receive on a readable channel, then every whole frame it completed."""
        io = source.io
        try:
            io.receive(block=False)
            while (frame := io.next_frame()) is not None:
                self.num_frames += 1
                source.on_frame(*frame)
        except wire.ChannelClosed:
            self._end(selector, source, None)
        except Exception as e:  # a malformed frame: that channel ends (its handler process restarts)
            self._end(selector, source, e)

    def _end(self, selector: selectors.BaseSelector, source: FrameSource, error: BaseException | None) -> None:
        try:
            selector.unregister(source.io.sock)
        except (KeyError, ValueError, OSError):
            pass
        try:
            source.on_end(error)
        except Exception as e:
            logger.warning(f"channel_intake.on_end_failed(error={e!r})")
