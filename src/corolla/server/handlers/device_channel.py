"""The core's end of the handler channels (`--num_handlers` > 1): one `DeviceChannel` per handler process serves its
frames (`protocol.channel_frames`) against the executor and the server's one `SpanCore`, re-checking only what a frame
can get wrong by itself (sizes, handles, block ranges, argument types). Calls and notes run in the event loop; steps
skip it: one intake thread reads every channel (`ChannelIntake`, decision 0004) and queues a frame's decode steps as
ONE runtime task, and the runtime thread sends each channel one REPLY_BATCH per merged forward (decision 0003). No send
blocks its sender: what the socket does not take at once waits in the channel's backlog, which the intake thread
drains; a handler process that stops reading is declared dead past a byte cap (at once) or a stall bound (one clock,
`DeviceChannel._watch`; decisions 0258, 0261)."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import math
import selectors
import socket
import struct
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Protocol

import torch
from hivemind.proto import runtime_pb2

from corolla.engine.batcher import StepResult
from corolla.engine.span_engine import StepRequest
from corolla.protocol import channel_frames as wire
from corolla.protocol.prefix import PrefixKeys
from corolla.server.core.admission import SessionTicket
from corolla.server.core.engine_executor import EngineExecutor, StepGroup
from corolla.server.core.executor import (
    KIND_ENGINE_INFERENCE,
    BackwardInputs,
    ForwardInputs,
    HandoffUnsupported,
    SessionCache,
    SessionOpen,
    SessionSpec,
    StepInputs,
)
from corolla.server.core.kv_handoff import check_handoff_frame
from corolla.server.core.peer_bytes import StreamLoans
from corolla.server.core.refusals import encode_error
from corolla.server.core.runtime import Task
from corolla.server.core.span_core import SpanCore
from corolla.utils.logging import get_logger
from corolla.utils.tensor_bytes import TensorBytes

logger = get_logger(__name__)

_STATE = struct.Struct(">QQd")  # what `_state` writes (`channel_frames.Writer.u64` x 2, `f64`)
# the STATE's drain deadline while the server does not drain (`channel_frames.Reader.f64`: None)
NOT_DRAINING = math.nan


INITIAL_BUFFER_BYTES = 1 << 16

# A handler process that has taken none of the bytes waiting for it this long is wedged (stopped, a loop that never
# returns, a bug), not slow: a live one's loop reads its channel between any two callbacks, and the pauses a loaded
# host gives it are seconds (decision 0252 injected 1-5 s). Its channel is declared dead (decision 0258).
WRITE_STALL_S = 30.0
# The bytes a channel may hold back for a process that reads slower than the core writes: at least this, and at
# least BACKLOG_FRAMES frames at the bound (a KV export's reply behind a forward's). The replies a live process waits
# for are bounded by its requests (the stream byte caps it is lent, 128 MiB by default), so more than this is a
# process that has fallen behind for good, and holding it would grow the device process's memory without bound.
BACKLOG_MIN_BYTES = 256 << 20
BACKLOG_FRAMES = 2
# What one drain turn of the intake thread copies at most while it holds a channel's send lock: a sender waiting for
# that lock waits for this much of a copy into the socket, not for a whole backlog (a process reading as fast as the
# core writes would otherwise keep the lock taken).
DRAIN_TURN_BYTES = 4 << 20
# A wedged process whose socket still takes frames never forms a backlog (its socket holds ~280 small frames: a quiet
# server's state broadcasts and evictions, or nothing), yet its sessions hold their cache and p2pd hands it new streams:
# each channel pings its process this many times a stall bound, and one it leaves unanswered for the bound ends the
# channel (`DeviceChannel._watch`).
STALL_TICKS = 3


class ChannelStalled(wire.ChannelClosed):
    """The handler process stopped reading its channel: its backlog passed its cap, or it took nothing for
    `WRITE_STALL_S`. The channel ends as if the process died (decision 0258)."""


class FrameSocket:
    """One end of a stream socket carrying `protocol.channel_frames` frames: non-blocking `recv_into`s into one reused
    buffer (frames that arrived together parsed out of one syscall), whole frames sent under one lock, never waiting
    for the other end: what the socket does not take at once waits in a backlog (in order, ahead of later frames)
    that a drainer (`ChannelIntake`) sends when the socket takes bytes again (`drain`). A backlog past
    `max_backlog_bytes`, or one the other end took nothing of for `stall_s` (`declare_stalled`, asked by the
    channel's watch), ends the socket (`failure`)."""

    def __init__(self, sock: socket.socket, max_frame_bytes: int):
        if max_frame_bytes < 1:
            raise ValueError(f"max_frame_bytes must be >= 1, got {max_frame_bytes}")
        sock.setblocking(True)  # reads and writes say MSG_DONTWAIT where they must not wait (all but a test's read)
        self.sock = sock
        self.max_frame_bytes = max_frame_bytes
        # whole frames: `max_frame_bytes` bounds a payload, its header comes on top
        self.max_backlog_bytes = max(BACKLOG_MIN_BYTES, BACKLOG_FRAMES * (wire.HEADER_BYTES + max_frame_bytes))
        self.stall_s = WRITE_STALL_S
        self._buffer = bytearray(min(INITIAL_BUFFER_BYTES, max_frame_bytes))
        self._start = 0  # received bytes not parsed yet: self._buffer[self._start : self._end]
        self._end = 0
        self._send_lock = threading.Lock()
        self.closed = False  # no more frames taken (closed, or declared dead); set under the send lock
        self.frames_sent = 0  # frames taken (sent or in the backlog), counted under the send lock
        self.failure: ChannelStalled | None = None  # why the socket was declared dead; set once, under the send lock
        # under the send lock: what the socket has not taken yet, oldest first, their bytes, and when the other end
        # last took any of it (`time.monotonic`; the backlog's start when it took nothing yet)
        self._backlog: collections.deque[memoryview] = collections.deque()
        self._backlog_bytes = 0
        self._taken_at = 0.0
        self._on_backlog: Callable[[], None] | None = None  # wakes the drainer when a backlog starts (`attach`)

    def _header(self) -> tuple[int, int, int] | None:
        """(length, kind, request id) of the next frame if its header is buffered, checked against the bounds
        (FrameError: an unknown kind, or a length over `max_frame_bytes`, before anything is allocated for it)."""
        if self._end - self._start < wire.HEADER_BYTES:
            return None
        length, kind, request_id = wire.HEADER.unpack_from(self._buffer, self._start)
        wire.check_header(length, kind, self.max_frame_bytes)
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
        """Takes whole frames in order (never interleaved with another thread's) and returns at once: sent now as far
        as the socket takes them when nothing is waiting before them, else after what is. False if the socket is
        closed, declared dead (now too: the backlog passed its cap), or the other end is gone (the reader sees that
        end and ends the channel)."""
        wake: Callable[[], None] | None = None
        with self._send_lock:
            if self.closed:
                return False
            self.frames_sent += len(frames)
            if self._backlog:
                sent = 0  # behind what waits already: all of them wait
            else:
                try:
                    sent = self._send_now(frames)
                except OSError as e:
                    logger.debug(f"device_channel.intake_send_failed(error={e!r})")
                    return False
                if sent == len(frames) and not self._backlog:
                    return True  # the usual case: the socket took them whole, nothing to hand over
                self._taken_at = time.monotonic()  # the stall clock starts with the backlog
                wake = self._on_backlog
            for frame in frames[sent:]:
                self._backlog.append(memoryview(frame))
                self._backlog_bytes += len(frame)
            if self._backlog_bytes > self.max_backlog_bytes:  # (its reader sees the end and ends the channel)
                self._declare_dead(f"backlog cap: {self._backlog_bytes} bytes not read, {self.max_backlog_bytes} taken")
            taken = not self.closed
        if wake is not None:
            wake()
        return taken

    def _send_now(self, frames: list[bytes]) -> int:
        """Sends frames as far as the socket takes them now (one syscall a frame, as `sendall` made); the number of
        frames done with: sent whole, or the last of them partly, its rest put in the backlog. Under the send lock,
        with the backlog empty."""
        for i, frame in enumerate(frames):
            try:
                n = self.sock.send(frame, socket.MSG_DONTWAIT)
            except BlockingIOError:
                return i
            if n < len(frame):
                rest = memoryview(frame)[n:]
                self._backlog.append(rest)
                self._backlog_bytes += len(rest)
                return i + 1
        return len(frames)

    def attach(self, on_backlog: Callable[[], None]) -> bool:
        """The drainer's `on_backlog` is called (from any sender's thread, outside the lock) whenever a backlog starts;
        True if one is waiting already (or the socket was declared dead before it was attached)."""
        with self._send_lock:
            self._on_backlog = on_backlog
            return bool(self._backlog) or self.failure is not None

    def drain(self) -> bool:
        """Sends what the socket takes of the backlog now, `DRAIN_TURN_BYTES` at most (the drainer, when the socket
        takes bytes); True once nothing waits (the drainer stops asking), the socket gone or declared dead included."""
        with self._send_lock:
            budget = DRAIN_TURN_BYTES
            while self._backlog and budget > 0:
                head = self._backlog[0]
                try:
                    n = self.sock.send(head, socket.MSG_DONTWAIT)
                except BlockingIOError:
                    break
                except OSError as e:  # the other end is gone: its reader sees that and ends the channel
                    logger.debug(f"device_channel.drain_failed(error={e!r})")
                    self._drop_backlog()
                    break
                self._taken_at = time.monotonic()
                self._backlog_bytes -= n
                budget -= n
                if n < len(head):
                    self._backlog[0] = head[n:]
                    break
                self._backlog.popleft()
            return not self._backlog

    @property
    def backlogged(self) -> bool:
        """Whether frames wait in the backlog (read without the lock: a stale answer is one tick late)."""
        return bool(self._backlog)

    def declare_dead(self, reason: str) -> None:
        """Declares the socket dead (`failure`: `ChannelStalled(reason)`): its reader sees the end."""
        with self._send_lock:
            self._declare_dead(reason)

    def declare_stalled(self, now: float) -> bool:
        """Declares the socket dead if the other end took nothing of its backlog for `stall_s` by `now`
        (`time.monotonic`); True if it is dead."""
        with self._send_lock:
            if self._backlog and now - self._taken_at >= self.stall_s:
                self._declare_dead(f"stall bound: nothing of {self._backlog_bytes} bytes read for {self.stall_s} s")
            return self.failure is not None

    def _declare_dead(self, reason: str) -> None:
        """Under the send lock: no more frames taken, the backlog dropped, both directions ended (the reader sees
        the end: the channel ends as a dead process's does)."""
        if self.failure is None:
            self.failure = ChannelStalled(f"handler channel stalled ({reason})")
        self.closed = True
        self._drop_backlog()
        self.shutdown()

    def _drop_backlog(self) -> None:
        self._backlog.clear()
        self._backlog_bytes = 0

    def shutdown(self) -> None:
        """Ends both directions: its reader (`receive`) sees the end (ChannelClosed), and so does the other end."""
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass  # already gone

    def close(self) -> None:
        self.shutdown()
        with self._send_lock:
            self.closed = True
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
        """The channel ended (None: its socket closed or the intake stopped; `ChannelStalled`: its process stopped
        reading); called once, in the intake thread."""
        ...


class ChannelIntake:
    """The device process's one reader of handler channels (see the module docstring), and the drainer of their
    backlogs: a channel whose socket holds frames back is watched for writing until they are out, and is ended
    (`on_end` with its `ChannelStalled`) once declared dead. Use as a context manager, or `close()`: the thread ends
    and every channel still registered ends with it."""

    def __init__(self, name: str = THREAD_NAME):
        self.name = name
        self._lock = threading.Lock()
        self._adding: list[FrameSource] = []
        self._writing: list[FrameSource] = []  # channels whose backlog started since the thread last looked
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
                logger.warning(f"device_channel.intake_close: thread still busy after {timeout_s} s")
                return
        for end in (self._wake_r, self._wake_w):
            end.close()

    def __enter__(self) -> ChannelIntake:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _want_write(self, source: FrameSource) -> None:
        """`source`'s backlog started (any thread): the intake watches its socket for writing."""
        with self._lock:
            self._writing.append(source)
        self._wake()

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
                for key, events in selector.select():
                    source: FrameSource | None = key.data
                    if source is None:
                        if not self._take_additions(selector):
                            return
                        continue
                    if events & selectors.EVENT_WRITE:
                        self._drain(selector, source)
                    if events & selectors.EVENT_READ:
                        self._read(selector, source)
        except Exception as e:  # a bug here would silence every channel: end them all, loudly
            logger.error(f"device_channel.intake_failed(error={e!r})")
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
        """Registers the channels added meanwhile and watches those whose backlog started for writing; False once the
        intake is closing."""
        try:
            while self._wake_r.recv(4096):
                pass
        except BlockingIOError:
            pass
        with self._lock:
            adding, self._adding = self._adding, []
            writing, self._writing = self._writing, []
            closing = self._closing
        for source in adding:
            try:
                selector.register(source.io.sock, selectors.EVENT_READ, source)
            except (OSError, ValueError) as e:  # closed before it could be read
                source.on_end(e)
                continue
            if source.io.attach(partial(self._want_write, source)):  # a backlog started before: drain it now
                writing.append(source)
        for source in writing:
            try:
                selector.modify(source.io.sock, selectors.EVENT_READ | selectors.EVENT_WRITE, source)
            except (KeyError, ValueError, OSError):
                continue  # ended meanwhile
        return not closing

    def _drain(self, selector: selectors.BaseSelector, source: FrameSource) -> None:
        """Sends what a writable channel's socket takes of its backlog; stops watching it for writing once empty."""
        if source.io.drain():
            with contextlib.suppress(KeyError, ValueError, OSError):
                selector.modify(source.io.sock, selectors.EVENT_READ, source)

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
        """Lets go of a channel and tells it once: `error`, else why its socket was declared dead (None: its end)."""
        try:
            selector.unregister(source.io.sock)
        except (KeyError, ValueError, OSError):
            pass
        if error is None:
            error = source.io.failure
        try:
            source.on_end(error)
        except Exception as e:
            logger.warning(f"device_channel.intake_on_end_failed(error={e!r})")


# a step's reply as a channel queues it: request id, output [B, T, H] or what refused it, the output's bytes if known
StepReply = tuple[int, torch.Tensor | TensorBytes | BaseException, memoryview | None]


class _FrameSteps:
    """A frame's decode steps, as columns (no record per step): request ids, tickets, the engine's requests, and
    their tokens in all."""

    __slots__ = ("request_ids", "tickets", "requests", "tokens")

    def __init__(self) -> None:
        self.request_ids: list[int] = []
        self.tickets: list[SessionTicket | None] = []
        self.requests: list[StepRequest] = []
        self.tokens = 0

    def add(self, request_id: int, ticket: SessionTicket | None, request: StepRequest) -> None:
        self.request_ids.append(request_id)
        self.tickets.append(ticket)
        self.requests.append(request)
        self.tokens += request.rows * request.num_tokens

    def part(self, start: int, end: int) -> _FrameSteps:
        """Steps [start, end) as a frame of their own (a frame split at the merge limit)."""
        part = _FrameSteps()
        part.request_ids, part.tickets = self.request_ids[start:end], self.tickets[start:end]
        part.requests = self.requests[start:end]
        part.tokens = sum(r.rows * r.num_tokens for r in part.requests)
        return part


class FrameIntake:
    """Turns a channel's step frames into runtime tasks and their results into replies (see the module docstring).

    `held(handle)` gives an open session's cache and ticket (FrameError if none); `queue_replies` appends replies to
    the channel's outbox (any thread); `flush` sends them (one distinct object: the runtime flushes it once per
    batch)."""

    def __init__(
        self,
        core: SpanCore,
        held: Callable[[int], tuple[SessionCache, SessionTicket | None]],
        queue_replies: Callable[[list[StepReply]], None],
        flush: Callable[[], None],
    ):
        self.executor, self.core = core.executor, core
        self._held, self._queue_replies, self._flush = held, queue_replies, flush
        self.num_frame_tasks = 0  # tasks that carried two or more steps of one frame

    def submit(self, kind: int, request_id: int, payload: memoryview) -> int:
        """Queues a STEP_BATCH's (or a STEP's) steps on the runtime, waking its thread once; refusals are answered
        at once. Returns the number of steps read. A malformed batch (count or lengths) raises FrameError."""
        steps: list[wire.ParsedStep | wire.BadStep]
        if kind == wire.STEP_BATCH:
            steps = wire.parse_steps(payload)
        else:
            try:
                steps = [wire.parse_step(request_id, payload)]
            except wire.FrameError as e:
                steps = [wire.BadStep(request_id, e)]
        refused: list[StepReply] = []
        tasks: list[Task] = []
        frame = _FrameSteps()  # the fast path's queued decode steps: one task (or a few)
        runtime = self.executor.runtime
        may_run_alone = self.core.admission.num_open <= 1  # alone in all processes (read once per frame)
        held, prepare_step = self._held, self.executor.prepare_step
        for step in steps:
            try:
                if isinstance(step, wire.BadStep):
                    raise step.error
                shape, dtype = step.shape, step.dtype
                if shape is None or dtype is None or len(shape) != 3:
                    raise wire.FrameError("a step needs hidden states [B, T, H]")
                cache, ticket = held(step.handle)
                # the hidden states as their bytes (no tensor unless the executor needs one: `StepInputs.tensor`)
                shadow = cache.spec.shadow
                alone = step.lone and may_run_alone and not shadow
                request = prepare_step(cache, StepInputs(None, step.prefix_length, step.prompts, step.hypo_ids,
                                                         step.adapter, alone, step.raw, (dtype, shape),
                                                         step.rows))  # fmt: skip
                if not alone and not shadow and request.is_decode:
                    frame.add(step.request_id, ticket, request)
                    continue
                task = self._task(step.request_id, ticket, request, shadow)
                if alone:  # a lone session: may run right here on an idle runtime
                    runtime.queue(task, inline=True)
                else:
                    tasks.append(task)
            except Exception as e:
                refused.append((step.request_id, e, None))
        if frame.request_ids:
            try:
                tasks.extend(self._frame_tasks(frame))
            except Exception as e:  # the runtime stopped meanwhile: each of these steps is refused
                refused.extend((rid, e, None) for rid in frame.request_ids)
        if tasks:
            try:
                runtime.queue(tasks)  # one lock and one wake for the frame
            except Exception as e:  # the runtime stopped: every step of the frame is refused
                for task in tasks:
                    assert task.on_done is not None
                    task.on_done(None, e)  # queues each of its steps' refusals
                if not refused:
                    self._flush()
        if refused:
            self._queue_replies(refused)
            self._flush()
        return len(steps)

    def _frame_tasks(self, frame: _FrameSteps) -> list[Task]:
        """The frame's decode steps in as few tasks as fit one merged forward each (in order): one task for the
        usual frame (within the limit), else split where the limit says (the executor's steps share one merge key)."""
        limit = self.executor.runtime.merge_limit(KIND_ENGINE_INFERENCE)
        if frame.tokens <= limit:
            return [self._group_task(frame)]
        tasks: list[Task] = []
        start, tokens = 0, 0
        for i, request in enumerate(frame.requests):
            size = request.rows * request.num_tokens
            if i > start and tokens + size > limit:
                tasks.append(self._group_task(frame.part(start, i)))
                start, tokens = i, 0
            tokens += size
        tasks.append(self._group_task(frame.part(start, len(frame.requests))))
        return tasks

    def _task(self, request_id: int, ticket: SessionTicket | None, request: StepRequest, shadow: bool = False) -> Task:
        """One runtime task for one step: its own payload and callback (a shadow session's step is queued last,
        never grouped: `EngineExecutor.step_task`)."""
        done = partial(self._step_done, request_id, ticket, request)
        return self.executor.step_task(request, shadow=shadow, on_done=done, flush=self._flush)

    def _group_task(self, frame: _FrameSteps) -> Task:
        """One runtime task for a frame's steps: a `StepGroup` (one step alone: its own task)."""
        if len(frame.requests) == 1:
            return self._task(frame.request_ids[0], frame.tickets[0], frame.requests[0])
        self.num_frame_tasks += 1
        return self.executor.step_task(
            StepGroup(frame.requests), on_done=partial(self._frame_done, frame), flush=self._flush
        )

    def _step_done(
        self, request_id: int, ticket: SessionTicket | None, request: StepRequest, output: torch.Tensor | None,
        error: BaseException | None,
    ) -> None:  # fmt: skip
        """One step's result, in the thread that ran it; the runtime then calls `flush` once for the batch."""
        self._queue_replies([_step_reply(request_id, ticket, request, error or output)])

    def _frame_done(self, frame: _FrameSteps, outputs: list[StepResult] | None, error: BaseException | None) -> None:
        """A frame task's results (one per step; `error`: the whole batch failed), queued under one lock."""
        if error is not None or outputs is None or len(outputs) != len(frame.request_ids):
            count = "no" if outputs is None else len(outputs)
            failed = error or RuntimeError(f"{count} results for a frame of {len(frame.request_ids)} steps")
            self._queue_replies([(rid, failed, None) for rid in frame.request_ids])
            return
        self._queue_replies([
            _step_reply(rid, ticket, request, out)
            for rid, ticket, request, out in zip(frame.request_ids, frame.tickets, frame.requests, outputs, strict=True)
        ])  # fmt: skip


def _step_reply(
    request_id: int,
    ticket: SessionTicket | None,
    request: StepRequest,
    result: torch.Tensor | TensorBytes | BaseException | None,
) -> StepReply:
    """A served step's reply (its session's ticket touched with its B x T tokens) or a refused one's."""
    if result is None or isinstance(result, BaseException):
        return (request_id, result if result is not None else RuntimeError("the step returned nothing"), None)
    if ticket is not None:
        ticket.touch(request.rows * request.num_tokens)
    # [B, T, H], encoded by whoever sends it (from its bytes, where a launched forward collected them)
    return (request_id, result, request.output_bytes)


def device_info(executor: EngineExecutor, span: tuple[int, ...], max_frame_bytes: int) -> wire.DeviceInfo:
    """The HELLO a handler process gets: enough to size sessions and caches without asking."""
    try:  # one block's canonical K/V for one sequence of one token (the same for every block of the span)
        layout = executor.handoff_layout(SessionSpec((span[0],), 1, 1))[0]
        shapes, refused = tuple((tuple(d.shape), str(d.dtype).removeprefix("torch.")) for d in layout), ""
    except HandoffUnsupported as e:
        shapes, refused = (), str(e)
    return wire.DeviceInfo(
        path=executor.path,
        max_frame_bytes=max_frame_bytes,
        block_bytes_per_token={i: executor.cache_bytes_per_token((i,)) for i in span},
        handoff_shapes=shapes,
        handoff_refused=refused,
    )


@dataclass(eq=False)
class _Held:
    """One session opened by a handler process, held open by its own task until CLOSE or the channel ends."""

    spec: SessionSpec
    close: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task[None] | None = None
    ticket: SessionTicket | None = None
    cache: SessionCache | None = None


class DeviceChannel:
    """Serves one handler process (see the module docstring)."""

    def __init__(
        self,
        index: int,
        sock: socket.socket,
        *,
        core: SpanCore,
        span: tuple[int, ...],
        max_frame_bytes: int,
        intake: ChannelIntake | None = None,
        on_sessions_changed: Callable[[], None] | None = None,
    ):
        self.index = index
        # the device process's one reader of every channel (handler_pool's); None: this channel gets one of its own
        self.intake = intake
        self.io = FrameSocket(sock, max_frame_bytes)
        self.executor, self.core, self.span = core.executor, core, span
        # a session opened or closed: every process learns the device's figures (a lone channel: this one)
        self.on_sessions_changed = on_sessions_changed if on_sessions_changed is not None else self.send_state
        self.max_frame_bytes = max_frame_bytes
        self.metrics = core.metrics  # the server's one set: handler processes report sessions and refusals here
        self.ready = asyncio.Event()  # the handler process registered its handlers
        self.pid = 0
        self.listen_maddr = ""  # the handler process's p2pd client socket (its streams arrive there)
        self.stream_names: list[str] = []
        self.sessions: dict[int, _Held] = {}
        self.imports: dict[int, tuple[str, int]] = {}  # the process's KV imports in flight: (peer, bytes) by handle
        self._recalls: dict[int, asyncio.Future[None]] = {}  # stream loans recalled and not answered yet, by id
        self._recall_ids = iter(range(1, 1 << 32))
        # the ping the handler process has not answered yet, and since when it counts (`_watch`)
        self._ping_ids = iter(range(1, 1 << 32))
        self._ping: int | None = None
        self._ping_since = 0.0
        self._handles = iter(range(1, 1 << 32))
        self._tasks: set[asyncio.Task[None]] = set()
        self._outbox: list[StepReply] = []  # step results not sent yet, from the intake and runtime threads
        self._outbox_lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ended: asyncio.Future[None] | None = None
        # a frame's steps -> runtime tasks (a frame's decode steps in one) -> replies; `_flush` bound once: the runtime
        # flushes each distinct object once per batch
        self.steps = FrameIntake(core, self._held_cache, self._queue_results, self._flush)
        # what a handler process may call (`RemoteCore`: a reply comes back) and note (one way): each one's argument
        # types, checked before it runs (a frame can get them wrong by itself), and what runs it
        self.calls: dict[str, tuple[Any, Callable[..., Awaitable[object]]]] = {
            "open": (tuple[tuple[int, int], int, int, float | None, str, str | None, int | None, bool], self._open),
            "close": (tuple[int], self._close),
            "forward": (tuple[str, tuple[int, int], torch.Tensor, torch.Tensor | None, str, int, float], self._forward),
            "backward": (tuple[str, tuple[int, int], torch.Tensor, torch.Tensor, torch.Tensor | None, str, float],
                         self._backward),
            "attach_prefix": (tuple[int, str, int, tuple[bytes, ...]], self._attach_prefix),
            "read_kv": (tuple[int, int], self._read_kv),
            "write_kv": (tuple[int, int, tuple[torch.Tensor, ...]], self._write_kv),
            "take_import": (tuple[str, int], self._take_import),
            "lend_stream": (tuple[str, int], self._lend_stream),
        }  # fmt: skip
        self.notes: dict[str, tuple[Any, Callable[..., None]]] = {
            "push": (tuple[str, str | None, bytes], self._push_in),
            "add_prefix_keys": (tuple[int, str, int, tuple[bytes, ...]], self._add_prefix_keys),
            "rejected": (tuple[str], self._rejected),
            "prefix_probe": (tuple[int, int], self._prefix_probe),
            "ready": (tuple[int, str, tuple[str, ...]], self._ready),
            "give_import": (tuple[int], self._give_import),
            "repay_stream": (tuple[str, int], self._repay_stream),
            "recalled": (tuple[int], self._recalled),
            "pong": (tuple[int], self._pong),
        }
        self.num_requests = 0  # counted by the intake thread only
        self.num_frames_in = 0
        self.num_sessions_opened = 0

    def close(self) -> None:
        """Ends the channel (the server stops): the intake reads its end, `serve` ends every session."""
        self.io.shutdown()

    # ---- output

    def _state_bytes(self) -> bytes:
        """The core's figures as every reply carries them (what a handler process's fronts read without asking):
        cache bytes left, the cache's size (two u64), the drain's deadline (f64, `time.monotonic`;
        `NOT_DRAINING`)."""
        executor, core = self.executor, self.core
        deadline = core.drain.deadline
        return _STATE.pack(
            max(0, executor.bytes_left), executor.max_size_bytes,
            NOT_DRAINING if deadline is None else deadline,
        )  # fmt: skip

    def send(self, kind: int, request_id: int, body: wire.Writer) -> bool:
        """Sends one frame from any thread, never waiting for the handler process to read it (`FrameSocket.send_frames`:
        what the socket does not take at once waits in the channel's backlog); False once the channel is shut down or
        declared dead."""
        return self.io.send_frames([body.frame(kind, request_id)])

    def _queue_results(self, results: list[StepReply]) -> None:
        with self._outbox_lock:
            self._outbox.extend(results)

    def _flush(self) -> None:
        """Sends every queued step reply (the runtime thread after a merged forward, the intake thread after refusing
        steps) in as few REPLY_BATCH frames as the bound allows, with the state once each."""
        with self._outbox_lock:
            results, self._outbox = self._outbox, []
        if results and not self.io.closed:
            head = self._state_bytes()
            self.io.send_frames(wire.reply_frames(results, head, self.max_frame_bytes, encode_error))  # [B, T, H] each

    def send_state(self) -> None:
        self._reply(wire.STATE, 0, wire.Writer())

    def _reply(self, kind: int, request_id: int, body: wire.Writer) -> None:
        """Sends `body` behind the core's figures (what every frame to a handler process but a note starts with)."""
        body.parts.insert(0, self._state_bytes())
        self.send(kind, request_id, body)

    # ---- input

    async def serve(self) -> None:
        """Serves until the handler process closes the channel or dies; then ends all of its sessions."""
        info = device_info(self.executor, self.span, self.max_frame_bytes)
        hello = wire.Writer()
        hello.parts.append(info.to_json())
        self.send(wire.HELLO, 0, hello)
        self.send_state()
        loop = self._loop = asyncio.get_running_loop()
        ended = self._ended = loop.create_future()
        intake = self.intake or ChannelIntake(f"corolla-channel-{self.index}")  # a channel alone: one of its own
        watch = asyncio.create_task(self._watch())
        try:
            intake.add(self)
            await asyncio.shield(ended)
        finally:
            watch.cancel()
            self.io.shutdown()  # the intake reads the end and lets go of this channel (`on_end`)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(asyncio.shield(ended), 10.0)
            if intake is not self.intake:
                await asyncio.to_thread(intake.close)
            await self._end_all()
            self.io.close()

    def on_frame(self, kind: int, request_id: int, payload: memoryview) -> None:
        """A frame, in the intake thread: steps straight to the runtime, everything else to the event loop."""
        self.num_frames_in += 1
        if kind in (wire.STEP_BATCH, wire.STEP):
            self.num_requests += self.steps.submit(kind, request_id, payload)
            return
        self.num_requests += 1
        assert self._loop is not None
        self._loop.call_soon_threadsafe(self._dispatch, kind, request_id, bytes(payload))

    def on_end(self, error: BaseException | None) -> None:
        """The intake let go of this channel: its socket ended, a frame was malformed or the process stopped reading
        (`error`), or it closed."""
        if error is None:
            logger.info(f"device_channel.closed(handler={self.index}, sessions={len(self.sessions)})")
        else:  # a malformed frame, or a wedged process: the channel ends (the handler process is replaced)
            logger.error(f"device_channel.failed(handler={self.index}, error={error!r})")
        if self._loop is not None and self._ended is not None:
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits
                self._loop.call_soon_threadsafe(_set_done, self._ended)

    async def _watch(self) -> None:
        """The channel's one stall clock: declares it dead (`ChannelStalled`) once the handler process has read nothing
        for the stall bound, however much or little the core sent it. While a backlog waits, what the process takes of
        it counts (a ping behind it does not); else each tick (`STALL_TICKS` a bound) with no ping out sends one (a
        "ping" note, answered by a "pong" as soon as the process's loop reads it), and one unanswered for the bound
        ends the channel."""
        io = self.io
        while not io.closed:
            await asyncio.sleep(io.stall_s / STALL_TICKS)
            now = time.monotonic()
            if io.backlogged:
                self._ping_since = now
                if io.declare_stalled(now):
                    return
            elif self._ping is not None:
                if now - self._ping_since >= io.stall_s:
                    io.declare_dead(f"ping unanswered: nothing read for {io.stall_s} s")
                    return
            else:
                self._ping, self._ping_since = next(self._ping_ids), now
                self.send(wire.NOTE, 0, wire.named("ping", (self._ping,)))

    def _dispatch(self, kind: int, request_id: int, payload: bytes) -> None:
        """A frame other than a step, in the event loop: a call answered in a task of its own (a malformed one fails
        its caller only), a note at once (a malformed one ends the channel)."""
        if kind == wire.CALL:
            self._start(request_id, payload)
            return
        try:
            if kind != wire.NOTE:
                raise wire.FrameError(f"frame kind {kind} is not a request")
            wire.dispatch(self.notes, *wire.read_named(payload))
        except wire.FrameError as e:
            logger.error(f"device_channel.bad_frame(handler={self.index}, kind={kind}, error={e!r}): channel ends")
            self.io.shutdown()

    def _start(self, request_id: int, payload: bytes) -> None:
        task = asyncio.create_task(self._answer(request_id, payload))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _answer(self, request_id: int, payload: bytes) -> None:
        try:
            body = wire.Writer().value(await wire.dispatch(self.calls, *wire.read_named(payload)))
        except Exception as e:
            self._reply(wire.REPLY_ERROR, request_id, encode_error(e))
            return
        self._reply(wire.REPLY_VALUE, request_id, body)

    # ---- notes (one way)

    def _push_in(self, session_id: str, sender: str | None, raw: bytes) -> None:
        self.core.push(session_id, runtime_pb2.ExpertRequest.FromString(raw), sender=sender or None)

    def _add_prefix_keys(self, handle: int, namespace: str, first: int, hashes: tuple[bytes, ...]) -> None:
        """Keys of a session's own client for publication (a session that ended meanwhile drops them)."""
        held = self.sessions.get(handle)
        if held is None or held.cache is None:
            return
        try:
            self.executor.add_prefix_keys(held.cache, namespace, PrefixKeys(first, hashes))
        except ValueError as e:  # the handler checked the keys and the namespace: only a broken invariant gets here
            logger.warning(f"device_channel.prefix_keys_refused(handler={self.index}, error={e!r})")

    def _rejected(self, reason: str) -> None:
        if self.metrics is not None:
            self.metrics.rejected(reason)

    def _prefix_probe(self, keyed_tokens: int, hit_tokens: int) -> None:
        if self.metrics is not None:
            self.metrics.prefix_probe(keyed_tokens=keyed_tokens, hit_tokens=hit_tokens)

    def _give_import(self, handle: int) -> None:
        """An import of the handler process ended: its bytes back to the core's count (once)."""
        held = self.imports.pop(handle, None)
        if held is not None:
            self.core.imports.give_back(*held)

    def _repay_stream(self, peer: str, nbytes: int) -> None:
        """The handler process gives back `nbytes` of `peer`'s stream loan (at most what it was lent)."""
        self._loans().repay(self, peer, nbytes)

    def _recalled(self, recall: int) -> None:
        """The handler process answered a recall (its repayments, sent before, are counted)."""
        answered = self._recalls.pop(recall, None)
        if answered is not None and not answered.done():
            answered.set_result(None)

    def _pong(self, ping: int) -> None:
        """The handler process read the channel up to its ping (`_watch`)."""
        if ping == self._ping:
            self._ping = None

    def _loans(self) -> StreamLoans:
        loans = self.core.stream_loans
        if loans is None:
            raise RuntimeError("this core lends no stream bytes (no handler processes)")
        return loans

    def _ready(self, pid: int, listen_maddr: str, stream_names: tuple[str, ...]) -> None:
        """The handler process registered its handlers: where p2pd sends its streams, and their names."""
        self.pid, self.listen_maddr, self.stream_names = pid, listen_maddr, list(stream_names)
        self.ready.set()

    # ---- calls (each in a task of its own)

    async def _end_all(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        for handle in list(self.imports):  # a handler process that died mid-import gives nothing back itself
            self._give_import(handle)
        if self.core.stream_loans is not None:  # and nothing of what it was lent
            self.core.stream_loans.forget(self)
        for answered in self._recalls.values():  # (what it held came back all the same)
            if not answered.done():
                answered.set_result(None)
        self._recalls.clear()
        for held in list(self.sessions.values()):
            held.close.set()
        holders = [h.task for h in self.sessions.values() if h.task is not None]
        if holders:
            await asyncio.wait(holders, timeout=10.0)
        self.sessions.clear()
        self.on_sessions_changed()

    def _blocks(self, blocks: tuple[int, int]) -> tuple[int, ...]:
        indices = tuple(range(*blocks))
        if not indices or indices[0] < self.span[0] or indices[-1] > self.span[-1]:
            raise wire.FrameError(f"blocks {blocks} are not inside the span {self.span[0]}:{self.span[-1] + 1}")
        return indices

    def _held_cache(self, handle: int) -> tuple[SessionCache, SessionTicket | None]:
        """An open session's cache and ticket (FrameError if no session with a cache has that handle)."""
        held = self.sessions.get(handle)
        if held is None or held.cache is None:
            raise wire.FrameError(f"no open session with a cache under handle {handle}")
        return held.cache, held.ticket

    async def _open(
        self,
        blocks: tuple[int, int],
        batch_size: int,
        max_length: int,
        alloc_timeout_s: float | None,
        peer: str,
        session_id: str | None,
        opening_tokens: int | None,  # what its opening request brings (admission: none, no wait in line)
        shadow: bool,
    ) -> tuple[int, bool]:
        spec = SessionSpec(self._blocks(blocks), batch_size, max_length, shadow=shadow)
        self.core.drain.check_accepting()  # Draining: no new sessions
        held = _Held(spec)
        opened: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        handle = next(self._handles)
        opening = SessionOpen(peer, spec, alloc_timeout_s, session_id, opening_tokens)
        held.task = asyncio.create_task(self._hold(handle, held, opening, opened))
        await opened  # raises the admission's or the allocation's refusal
        self.sessions[handle] = held
        self.num_sessions_opened += 1
        self.on_sessions_changed()
        return handle, held.cache is not None

    async def _hold(self, handle: int, held: _Held, opening: SessionOpen, opened: asyncio.Future[None]) -> None:
        try:
            session_id = opening.session_id
            sink = partial(self._push_out, session_id) if session_id is not None else None
            async with self.core.open_session(opening, sink) as (ticket, cache):
                held.ticket, held.cache = ticket, cache
                opened.set_result(None)
                evicted = asyncio.ensure_future(ticket.evicted.wait())
                closing = asyncio.ensure_future(held.close.wait())
                try:
                    await asyncio.wait({evicted, closing}, return_when=asyncio.FIRST_COMPLETED)
                    if not closing.done() and ticket.eviction is not None:  # the stream's process ends the session
                        self.send(wire.NOTE, 0, wire.named("evict", (handle, str(ticket.eviction))))
                        await closing
                finally:
                    evicted.cancel()
                    closing.cancel()
        except BaseException as e:
            if not opened.done():
                opened.set_exception(e if isinstance(e, Exception) else RuntimeError("session open was cancelled"))
            if not isinstance(e, Exception):
                raise

    async def _close(self, handle: int) -> None:
        held = self.sessions.pop(handle, None)
        if held is not None:
            held.close.set()
            if held.task is not None:
                await asyncio.wait({held.task}, timeout=10.0)
            self.on_sessions_changed()

    def _push_out(self, session_id: str, request: runtime_pb2.ExpertRequest, sender: str | None) -> bool:
        """A push for a session of this channel's process: there, its stream's guard decides."""
        if self.io.closed:
            return False
        return self.send(wire.NOTE, 0, wire.named("push", (session_id, sender, request.SerializeToString())))

    async def _forward(
        self, peer: str, blocks: tuple[int, int], hidden: torch.Tensor, prompts: torch.Tensor | None, adapter: str,
        chunk_tokens: int, timeout_s: float,
    ) -> torch.Tensor:  # fmt: skip
        inputs = ForwardInputs(hidden, prompts, adapter)  # in one of its peer's slots of the core
        return await self.core.forward(
            peer, self._blocks(blocks), inputs, chunk_tokens=chunk_tokens, timeout_s=timeout_s
        )

    async def _backward(
        self, peer: str, blocks: tuple[int, int], hidden: torch.Tensor, grads: torch.Tensor,
        prompts: torch.Tensor | None, adapter: str, timeout_s: float,
    ) -> tuple[torch.Tensor, ...]:  # fmt: skip
        inputs = BackwardInputs(hidden, grads, prompts, adapter)
        return tuple(await self.core.backward(peer, self._blocks(blocks), inputs, timeout_s=timeout_s))

    async def _attach_prefix(self, handle: int, namespace: str, first: int, hashes: tuple[bytes, ...]) -> int:
        return await self.core.attach_prefix(self._held_cache(handle)[0], namespace, PrefixKeys(first, hashes))

    async def _read_kv(self, handle: int, position: int) -> tuple[torch.Tensor, ...]:
        tensors = await self.core.read_kv(self._held_cache(handle)[0], position)
        check_handoff_frame(tensors, self.max_frame_bytes)  # the client replays a cache too big for one frame
        return tuple(tensors)

    async def _write_kv(self, handle: int, position: int, tensors: tuple[torch.Tensor, ...]) -> None:
        # the tensors were validated by the handler process's front
        await self.core.write_kv(self._held_cache(handle)[0], list(tensors), position)

    async def _take_import(self, peer: str, nbytes: int) -> int:
        """Counts a KV import of the handler process in the core's imports in flight (its refusal goes back as
        is); the handle its "give_import" note names."""
        if nbytes < 0:
            raise wire.FrameError(f"a KV import of {nbytes} bytes")
        self.core.imports.take(peer, nbytes)
        handle = next(self._handles)
        self.imports[handle] = (peer, nbytes)
        return handle

    async def _lend_stream(self, peer: str, nbytes: int) -> int:
        """Lends the handler process `nbytes` more of `peer`'s stream bytes (the core's refusal goes back as is)."""
        if nbytes <= 0:
            raise wire.FrameError(f"a stream loan of {nbytes} bytes")
        await self._loans().lend(self, peer, nbytes)
        return nbytes

    async def recall_streams(self, peer: str, peer_bytes: int, any_bytes: int, reclaim_bytes: int) -> None:
        """Asks the handler process back for idle stream loans (`peer_bytes.LoanHolder`): a "recall_stream" note,
        answered by its "recalled" after its repayments, or by the channel's end (`_end_all`); returns at once where
        the note cannot be sent (the channel is ending: its loans come back without an answer)."""
        recall = next(self._recall_ids)
        answered = asyncio.get_running_loop().create_future()
        self._recalls[recall] = answered  # (before the note: an end that comes after it answers this one too)
        try:
            note = wire.named("recall_stream", (recall, peer, peer_bytes, any_bytes, reclaim_bytes))
            if self.send(wire.NOTE, 0, note):  # (False once shut down: no answer is coming)
                await answered
        finally:
            self._recalls.pop(recall, None)


def _set_done(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)
