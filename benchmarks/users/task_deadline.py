"""`TaskDeadline`: one task's reusable deadline scope for the per-step waits of a stream (the next request, the
step's compute, a message's reads), with a lazily moved timer: the "tasks" front shape of `front_shapes` (the server's
fronts wait by callbacks and `FrameConnection`'s timers, decision 0130).

`asyncio.timeout` arms a timer per use (a Timeout object, `call_at`, a heap push, a cancel and the loop's lazy
removal: ~12 us a use on the dev VM) and a decode step used three. A `TaskDeadline` keeps at most one timer per
task: entering a scope only records its deadline (and re-arms the timer when it would fire too late, i.e. the new
deadline is earlier than the armed one); when the timer fires before the current deadline (the deadline moved
later meanwhile) it re-arms itself for it, so a stream whose deadlines keep moving later costs about one timer per
timeout period instead of one per step. Semantics are `asyncio.timeout_at`'s: the task is cancelled at the
deadline while inside the scope, and the cancellation surfaces as `TimeoutError` when it was ours alone (a
cancellation from elsewhere stays a `CancelledError`)."""

from __future__ import annotations

import asyncio
from types import TracebackType
from typing import Protocol, cast

__all__ = ["TASK_DEADLINES", "TaskDeadline"]

TASK_DEADLINES = hasattr(asyncio, "timeout_at")  # Python >= 3.11 (Task.uncancel): else a timeout task per wait

EARLY_FIRE_S = 1e-4  # a timer that fires this close before the deadline expires the scope (no re-arm for less)


class _Task(Protocol):
    """The `asyncio.Task` methods used here (`cancelling`/`uncancel`: Python >= 3.11, where this module is used)."""

    def cancel(self, msg: object = None) -> bool: ...

    def cancelling(self) -> int: ...

    def uncancel(self) -> int: ...


class TaskDeadline:
    """Deadline scopes of one task, entered one at a time (`scope(when)`: a `with` block around awaits in that task).

    `when` is an `asyncio` loop time (`loop.time()`), None for no deadline. Not thread-safe: the task's loop only."""

    def __init__(self, loop: asyncio.AbstractEventLoop | None = None):
        self.loop = loop if loop is not None else asyncio.get_running_loop()
        self._task: _Task | None = None
        self._when: float | None = None  # the current scope's deadline (None: none, or no scope)
        self._next_when: float | None = None  # the deadline of the scope being entered
        self._active = False  # inside a scope
        self._expiring = False  # this scope's cancellation was requested by us
        self._cancelling = 0  # the task's cancelling() count when the scope was entered
        self._timer: asyncio.TimerHandle | None = None
        self._timer_when = 0.0
        self.num_timers = 0  # timers armed over this object's life (tests, measurements)

    def scope(self, when: float | None) -> TaskDeadline:
        """A deadline for the awaits inside the `with` block: `TimeoutError` out of the block if it is reached
        there (a class-based context manager: no generator per use)."""
        self._next_when = when
        return self

    def __enter__(self) -> TaskDeadline:
        if self._active:
            raise RuntimeError("TaskDeadline scopes do not nest")
        current = asyncio.current_task(self.loop)  # (the loop given: no get_running_loop, a getpid() syscall)
        if current is None:
            raise RuntimeError("TaskDeadline.scope must be used inside a task")
        task = cast(_Task, current)
        when = self._next_when
        self._task, self._when, self._active, self._expiring = task, when, True, False
        self._cancelling = task.cancelling()
        if when is not None and (self._timer is None or self._timer_when > when):
            self._arm(when)  # a deadline already past fires at the next loop iteration, at the block's first await
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self._active, self._when = False, None
        if not self._expiring:
            return
        assert self._task is not None
        if self._task.uncancel() <= self._cancelling and exc_type is asyncio.CancelledError:
            raise TimeoutError from error  # ours alone: the deadline was reached inside the block
        # else a cancellation from elsewhere too (it stays one), or the block swallowed ours (taken back, as asyncio)

    @property
    def expired(self) -> bool:
        """True if the current (or, after it, the last) scope's deadline was reached or `expire_now` ended it."""
        return self._expiring

    def move(self, when: float | None) -> None:
        """Moves the current scope's deadline (None: none); a later one costs nothing until the timer fires."""
        if not self._active:
            raise RuntimeError("TaskDeadline.move outside a scope")
        self._when = when
        if when is not None and not self._expiring and (self._timer is None or self._timer_when > when):
            self._arm(when)

    def close(self) -> None:
        """Cancels the timer (the stream is over)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _arm(self, when: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer, self._timer_when = self.loop.call_at(when, self._fired), when
        self.num_timers += 1

    def _fired(self) -> None:
        self._timer = None
        if not self._active or self._expiring or self._when is None:
            return  # no scope now: the next scope arms a timer for itself
        if self._when <= self.loop.time() + EARLY_FIRE_S:
            self._expire()
        else:
            self._arm(self._when)  # the deadline moved later since this timer was armed

    def _expire(self) -> None:
        assert self._task is not None
        self._expiring = True
        self._task.cancel()
