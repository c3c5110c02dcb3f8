"""The event core: a simulated clock and a heap of timed callbacks, ordered by (time, insertion order) so that a run
is reproducible bit for bit; events can be cancelled in O(1) (dropped lazily when popped)."""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from typing import Any


class Event:
    """A scheduled callback; `cancel()` keeps it from running."""

    __slots__ = ("args", "callback", "cancelled", "time_s")

    def __init__(self, time_s: float, callback: Callable[..., Any], args: tuple[Any, ...]):
        self.time_s, self.callback, self.args, self.cancelled = time_s, callback, args, False

    def cancel(self) -> None:
        self.cancelled = True


class EventLoop:
    """Runs callbacks in time order; ties run in the order they were scheduled."""

    def __init__(self) -> None:
        self.now_s = 0.0
        self.events_run = 0
        self._heap: list[tuple[float, int, Event]] = []
        self._order = itertools.count()

    def at(self, time_s: float, callback: Callable[..., Any], *args: Any) -> Event:
        if time_s < self.now_s:
            raise ValueError(f"cannot schedule in the past: {time_s} < now {self.now_s}")
        event = Event(time_s, callback, args)
        heapq.heappush(self._heap, (time_s, next(self._order), event))
        return event

    def after(self, delay_s: float, callback: Callable[..., Any], *args: Any) -> Event:
        if not delay_s >= 0:
            raise ValueError(f"delay must be >= 0, got {delay_s}")
        return self.at(self.now_s + delay_s, callback, *args)

    def run(self, until_s: float) -> None:
        """Runs every event due at or before `until_s`, then leaves the clock at `until_s`."""
        heap = self._heap
        while heap and heap[0][0] <= until_s:
            time_s, _, event = heapq.heappop(heap)
            if event.cancelled:
                continue
            self.now_s = time_s
            self.events_run += 1
            event.callback(*event.args)
        self.now_s = max(self.now_s, until_s)

    def pending(self) -> int:
        return sum(1 for _, _, event in self._heap if not event.cancelled)
