"""Waits that Ctrl-C can end. CPython runs signal handlers in the main thread only, but the kernel delivers a
process's SIGINT to any of its threads that does not block it (hivemind's, torch's, ours). A main thread blocked in
an untimed lock wait or `poll(2)` is then not woken: it sees the KeyboardInterrupt only when that wait ends, which for
a client waiting out a swarm with missing blocks is never (`corolla-generate` ignored Ctrl-C now and then).

So every wait on a path the main thread takes is cut into slices of at most `WAIT_SLICE_S`; between slices the
interpreter runs the pending handlers. A slice that ends early costs nothing: a result that arrives wakes the wait
at once, as before."""

from __future__ import annotations

import concurrent.futures
import select
import threading
import time
from collections.abc import Iterator
from typing import TextIO, TypeVar

T = TypeVar("T")

WAIT_SLICE_S = 0.25  # the most a pending Ctrl-C waits for a blocked main thread to notice it


def _slices(timeout_s: float | None) -> Iterator[float]:
    """The lengths of a wait's slices: each at most `WAIT_SLICE_S`, the last one ending at `timeout_s` (None: no end;
    at least one slice, of 0 s for a `timeout_s` of 0)."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
        yield WAIT_SLICE_S if deadline is None else max(0.0, min(WAIT_SLICE_S, deadline - time.monotonic()))
        if deadline is not None and time.monotonic() >= deadline:
            return


def future_result(future: concurrent.futures.Future[T], timeout_s: float | None = None) -> T:
    """`future.result(timeout_s)` in slices (see the module docstring): the result, the future's own exception, or
    `concurrent.futures.TimeoutError` (= TimeoutError) once `timeout_s` passed without a result."""
    for slice_s in _slices(timeout_s):
        try:
            return future.result(slice_s)  # one condition wait (concurrent.futures.wait builds waiters per call)
        except concurrent.futures.TimeoutError:
            if future.done():  # the future's own TimeoutError, or a result that came just now
                return future.result()
    raise concurrent.futures.TimeoutError(f"no result within {timeout_s} s")


def event_wait(event: threading.Event, timeout_s: float | None = None) -> bool:
    """`event.wait(timeout_s)` in slices (see the module docstring): True once set, False past `timeout_s`."""
    return any(event.wait(slice_s) for slice_s in _slices(timeout_s))


def wait_for_line(stream: TextIO) -> None:
    """Returns once a terminal `stream` has a line to read (or its end), waiting in slices (see the module docstring):
    `input()` on a terminal sleeps in read(2), which a SIGINT handled by another thread does not wake. Returns at
    once for anything but a terminal (a pipe's reader may already hold the next lines in its buffer)."""
    try:
        if not stream.isatty():
            return
        fd = stream.fileno()
    except (AttributeError, OSError, ValueError):  # replaced or closed stdin (pytest's, a redirected one)
        return
    poller = select.poll()
    poller.register(fd, select.POLLIN | select.POLLHUP)
    while not poller.poll(WAIT_SLICE_S * 1000):
        pass
