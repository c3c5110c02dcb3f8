"""How the runtime hands results back: a future resolved inside its own event loop, or a callback task's `on_done`
run in the thread that ran it, then its batch's flushes (`Runtime`, `server.task`)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from corolla.server.task import Task
from corolla.utils.logging import get_logger

logger = get_logger(__name__)


def call_back(tasks: list[Task], results: list[tuple[Any, BaseException | None]]) -> None:
    """Runs each callback task's `on_done`, then each distinct `flush` once (a failing callback is logged: it must
    not stop the device thread or the other callers' replies)."""
    flushes: dict[Callable[[], None], None] = {}  # keyed by the callable: equal bound methods flush once
    for task, (result, error) in zip(tasks, results, strict=True):
        try:
            if task.on_done is not None:
                task.on_done(result, error)
        except Exception as e:
            logger.warning(f"runtime.callback_failed(kind={task.kind}, error={e!r})")
        if task.flush is not None:
            flushes[task.flush] = None
    for flush in flushes:
        try:
            flush()
        except Exception as e:
            logger.warning(f"runtime.flush_failed(error={e!r})")


def deliver_batch(batch: list[Task], results: list[tuple[Any, BaseException | None]]) -> None:
    """A finished batch's results: callback tasks' replies leave from this thread (`call_back`), futures are
    resolved in their loops, one wake-up per loop for the batch."""
    if batch[0].future is None and all(t.future is None for t in batch):  # only callback tasks (device channels)
        call_back(batch, results)
        return
    if any(t.future is None for t in batch):  # callback tasks: their replies leave from this thread
        call_back(
            [t for t in batch if t.future is None],
            [r for t, r in zip(batch, results, strict=True) if t.future is None],
        )
        kept = [(t, r) for t, r in zip(batch, results, strict=True) if t.future is not None]
        batch, results = [t for t, _ in kept], [r for _, r in kept]
        if not batch:
            return
    if len(batch) == 1:
        deliver(batch[0], *results[0])
        return
    by_loop: dict[int, tuple[asyncio.AbstractEventLoop, list]] = {}  # one loop wake-up per batch, not per task
    for task, (result, error) in zip(batch, results, strict=True):
        assert task.loop is not None
        by_loop.setdefault(id(task.loop), (task.loop, []))[1].append((task.future, result, error))
    for loop, items in by_loop.values():
        try:
            loop.call_soon_threadsafe(resolve_all, items)
        except RuntimeError:  # the loop is closed: nobody is waiting any more
            logger.debug(f"runtime.deliver_dropped(kind={batch[0].kind}, tasks={len(items)}): event loop closed")


def deliver(task: Task, result: Any, error: BaseException | None) -> None:
    """Resolves the task's future inside its own event loop (thread-safe), or runs its callback here."""
    if task.future is None or task.loop is None:
        call_back([task], [(result, error)])
        return
    try:
        task.loop.call_soon_threadsafe(resolve, task.future, result, error)
    except RuntimeError:  # the loop is closed: nobody is waiting any more
        logger.debug(f"runtime.deliver_dropped(kind={task.kind}): event loop closed")


def resolve(future: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if future.done():  # cancelled by its caller meanwhile
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


def resolve_all(items: list[tuple[asyncio.Future, Any, BaseException | None]]) -> None:
    for future, result, error in items:
        resolve(future, result, error)
