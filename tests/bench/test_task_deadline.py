"""`benchmarks.users.task_deadline.TaskDeadline` (the "tasks" front shape of `front_shapes`) against
`asyncio.timeout_at`: expiry, moved deadlines with one timer, foreign cancellation."""

from __future__ import annotations

import asyncio

import pytest

from benchmarks.users.task_deadline import TaskDeadline


async def _sleep_in_scope(deadlines: TaskDeadline, when: float | None, sleep_s: float) -> None:
    with deadlines.scope(when):
        await asyncio.sleep(sleep_s)


async def test_deadline_expires_as_timeout_error() -> None:
    loop = asyncio.get_running_loop()
    deadlines = TaskDeadline(loop)
    started = loop.time()
    with pytest.raises(TimeoutError):
        await _sleep_in_scope(deadlines, started + 0.05, 5)
    assert deadlines.expired and 0.04 <= loop.time() - started < 1
    await _sleep_in_scope(deadlines, loop.time() + 5, 0.01)  # the next scope starts fresh
    assert not deadlines.expired
    with pytest.raises(TimeoutError):  # a deadline already past ends the block at its first await
        await _sleep_in_scope(deadlines, loop.time() - 1, 5)
    with deadlines.scope(loop.time() - 1):
        pass  # a block that never awaits is not cancelled, now or at a later await
    await asyncio.sleep(0.01)
    deadlines.close()


async def test_deadlines_moving_later_share_one_timer() -> None:
    loop = asyncio.get_running_loop()
    deadlines = TaskDeadline(loop)
    for _ in range(200):  # a stream's per-step waits: each deadline later than the last
        await _sleep_in_scope(deadlines, loop.time() + 0.05, 0)
    assert deadlines.num_timers == 1  # asyncio.timeout_at would have armed 200
    # the timer fires before the current deadline: re-armed once, the scope still ends at its own deadline
    started = loop.time()
    with deadlines.scope(started + 0.2):
        await asyncio.sleep(0.1)
    assert deadlines.num_timers == 2 and not deadlines.expired
    with pytest.raises(TimeoutError):
        await _sleep_in_scope(deadlines, loop.time() + 0.02, 5)  # earlier than the armed timer: re-armed
    deadlines.close()


async def test_move() -> None:
    loop = asyncio.get_running_loop()
    deadlines = TaskDeadline(loop)

    async def moved() -> None:
        with deadlines.scope(None) as scope:
            await asyncio.sleep(0.01)
            scope.move(loop.time() + 0.02)
            await asyncio.sleep(5)

    with pytest.raises(TimeoutError):
        await asyncio.wait_for(moved(), 2)
    await _sleep_in_scope(deadlines, None, 0.01)
    deadlines.close()


async def test_a_foreign_cancellation_stays_a_cancellation() -> None:
    loop = asyncio.get_running_loop()
    deadlines = TaskDeadline(loop)
    task = asyncio.ensure_future(_sleep_in_scope(deadlines, loop.time() + 30, 30))
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert not deadlines.expired
    with pytest.raises(RuntimeError, match="do not nest"):
        with deadlines.scope(None), deadlines.scope(None):
            pass
    deadlines.close()


# ---- the step structure's msgpack shortcut --------------------------------------------------------------------
