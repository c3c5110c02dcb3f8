"""Late tasks: while the runtime thread waits for the forward the device runs, it hands the steps that arrive to
the forward launched behind it (a `JoinableBatch`: the engine leaves rows free in it, `engine.graph_decode`), so
they ride that forward instead of waiting for the one after it. Without this, a launched-ahead forward takes only
the steps queued at its launch, and a step arriving while the device runs waits for about 2.5 forwards; with it,
for about 1.5.

The runtime asks `join_while_running` between launching a batch and waiting for the one before it; tasks a batch
takes are appended to it, and those the device turns out not to have run (`JoinMissed`: they joined just as it
started) are queued again by the runtime (`split_missed`)."""

from __future__ import annotations

from corolla.server.task import JoinableBatch, JoinMissed, LaunchedBatch, PendingBatch, TaskQueue

# How often the waiting runtime thread looks at the device (between pushes, which wake it at once): the replies of
# the finished forward wait at most this long beyond its end
POLL_S = 0.00005


def join_while_running(queue: TaskQueue, running: PendingBatch, open_batch: LaunchedBatch) -> int:
    """Until the device finished `running` (or `open_batch` is full), offers `open_batch` the queued tasks of its kind
    and merge key; returns the steps it took. Nothing happens unless both are `JoinableBatch`es."""
    handle = open_batch.handle
    if not isinstance(handle, JoinableBatch) or not isinstance(running, JoinableBatch):
        return 0
    first = open_batch.batch[0]
    joined = 0
    while handle.room > 0 and not running.ready():
        tasks = queue.pop_matching(first, handle.can_join, handle.room, POLL_S)
        if tasks is None:  # closed
            break
        refused = []
        for task in tasks:
            if handle.join(task):
                open_batch.batch.append(task)
                joined += task.steps
            else:
                refused.append(task)
        if refused:  # they go to a later launch (which reports any error); a full batch ends the loop above
            queue.requeue(refused)
            break
    return joined


def split_missed(launched: LaunchedBatch, results: list) -> list:
    """The tasks of `launched` whose result is `JoinMissed`, removed from it and from `results` (in place)."""
    missed = [i for i, (_, error) in enumerate(results) if isinstance(error, JoinMissed)]
    if not missed:
        return []
    tasks = [launched.batch[i] for i in missed]
    for i in reversed(missed):
        del launched.batch[i]
        del results[i]
    return tasks
