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
