"""An asyncio loop that polls instead of sleeping for a while after each I/O event, so that the reply to a request
it just sent is picked up without the wake-up latency of an idle core (tens of microseconds on a VM).

Only for a loop whose thread is the process's only busy Python thread (a client process driving inference): a
polling thread takes the GIL back microseconds after each poll, so another Python thread waiting for the GIL would
wait for the interpreter's 5 ms switch interval. Never use it for a server's loop (its runtime thread needs the GIL).
"""

from __future__ import annotations

import asyncio
import selectors
import time


class BusyPollSelector(selectors.DefaultSelector):  # type: ignore[misc,valid-type]
    """`select` polls without blocking until `window_s` after the last event (or the caller's timeout), then
    blocks as usual: a loop that has gone quiet for `window_s` sleeps and costs nothing."""

    def __init__(self, window_s: float):
        super().__init__()
        if window_s < 0:
            raise ValueError(f"busy-poll window must be >= 0 s, got {window_s}")
        self.window_s = window_s
        self._hot_until = 0.0

    def select(self, timeout: float | None = None) -> list:
        events = super().select(0)
        now = time.monotonic()
        if not events and (timeout is None or timeout > 0):
            deadline = None if timeout is None else now + timeout
            spin_until = self._hot_until if deadline is None else min(self._hot_until, deadline)
            while not events and now < spin_until:
                events = super().select(0)
                now = time.monotonic()
            if not events:
                events = super().select(None if deadline is None else max(0.0, deadline - now))
                now = time.monotonic()
        if events:
            self._hot_until = now + self.window_s
        return events


def new_event_loop(window_s: float) -> asyncio.AbstractEventLoop:
    """A loop polling for `window_s` after each event (a plain loop for 0)."""
    if window_s <= 0:
        return asyncio.new_event_loop()
    return asyncio.SelectorEventLoop(BusyPollSelector(window_s))
