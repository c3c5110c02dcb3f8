"""An asyncio loop that can poll instead of sleeping, so that an expected message is picked up without the
wake-up latency of an idle core (measured at 0.2-0.4 ms per wake-up on the lent H100/H200 VMs).

The owner says when a message is due (`keep_hot(seconds)`) and when it came (`cool()`). Polling is only safe while
the loop's thread is the only Python thread with work: a polling thread retakes the GIL microseconds after each
poll, so another thread waiting for the GIL waits for the interpreter's switch interval (5 ms). So a server keeps its
loop hot only right after a lone session's inline step (its device thread idle), a client only while its process's
only inference step is in flight (the user's thread blocked on it).
"""

from __future__ import annotations

import asyncio
import contextlib
import selectors
import signal
import socket
import threading
import time
from collections.abc import Coroutine, Iterator
from typing import Any, TypeVar

T = TypeVar("T")


class BusyPollSelector(selectors.DefaultSelector):
    """`select` polls without blocking until the hot period ends (or the caller's timeout), then blocks as usual:
    a loop that is not hot sleeps and costs nothing. With `linger_s` > 0, every `select` that found events keeps the
    loop hot for `linger_s` more (a loop that serves a stream of messages on a thread of its own: it sleeps only
    after `linger_s` without any)."""

    def __init__(self, linger_s: float = 0.0) -> None:
        super().__init__()
        if not 0.0 <= linger_s <= 1.0:
            raise ValueError(f"busy-poll linger must be in [0, 1] s, got {linger_s}")
        self.linger_s = linger_s
        self._hot_until = 0.0
        self.polled_events = 0  # select calls that found events while polling (would otherwise have slept)

    def keep_hot(self, seconds: float) -> None:
        """Poll for the next `seconds` (from the loop's thread)."""
        self._hot_until = max(self._hot_until, time.monotonic() + seconds)

    def cool(self) -> None:
        """Stop polling now (the expected message came)."""
        self._hot_until = 0.0

    def select(self, timeout: float | None = None) -> list:
        events = self._select(timeout)
        if events and self.linger_s > 0.0:
            self._hot_until = time.monotonic() + self.linger_s
        return events

    def _select(self, timeout: float | None) -> list:
        now = time.monotonic()
        if now < self._hot_until and (timeout is None or timeout > 0):
            deadline = None if timeout is None else now + timeout
            spin_until = self._hot_until if deadline is None else min(self._hot_until, deadline)
            while now < spin_until:
                events = super().select(0)
                if events:
                    self.polled_events += 1
                    return events
                now = time.monotonic()
            timeout = None if deadline is None else max(0.0, deadline - now)
        return super().select(timeout)


def new_event_loop(selector: BusyPollSelector | None = None) -> asyncio.AbstractEventLoop:
    return asyncio.new_event_loop() if selector is None else asyncio.SelectorEventLoop(selector)


def run(coro: Coroutine[Any, Any, T], selector: BusyPollSelector | None = None) -> T:
    """`asyncio.run(coro)` on a loop using `selector` (cancels what is left, closes async generators and the
    default executor, closes the loop)."""
    loop = new_event_loop(selector)
    try:
        asyncio.set_event_loop(loop)
        with wake_on_signals(loop):
            return loop.run_until_complete(coro)
    finally:
        try:
            pending = [task for task in asyncio.all_tasks(loop) if not task.done()]
            for task in pending:
                task.cancel()
            if pending:
                loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.run_until_complete(loop.shutdown_default_executor())
        finally:
            asyncio.set_event_loop(None)
            loop.close()


@contextlib.contextmanager
def wake_on_signals(loop: asyncio.AbstractEventLoop) -> Iterator[None]:
    """While the block runs `loop` in the main thread: any signal wakes the loop, so that the handlers installed with
    `signal.signal` (corolla-server's SIGTERM/SIGINT) run at once. The kernel may deliver a process's signal to
    another thread (the runtime's, torch's); CPython then only flags it for the main thread, which sleeps in the
    selector until its next timer (see utils.interrupts). Elsewhere (a server in a thread) it does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    wake_read, wake_write = socket.socketpair()
    wake_read.setblocking(False)
    wake_write.setblocking(False)
    loop.add_reader(wake_read.fileno(), _drain, wake_read)
    previous = signal.set_wakeup_fd(wake_write.fileno(), warn_on_full_buffer=False)
    try:
        yield
    finally:
        signal.set_wakeup_fd(previous)
        loop.remove_reader(wake_read.fileno())
        wake_read.close()
        wake_write.close()


def _drain(sock: socket.socket) -> None:
    with contextlib.suppress(BlockingIOError, InterruptedError):
        while sock.recv(4096):
            pass
