"""Runtime callback tasks as a device channel queues them: a frame's steps queued at once (one lock, one wake) run in
one merged batch with one flush per channel (a bound method given per task counts once), a kind's merge limit keeps
one batch to what one device call serves, and a stopped runtime refuses a frame's steps as a whole; and a front's
steps' `Task.then`, run inside the loop's delivery of their batch."""

from __future__ import annotations

import asyncio
import functools
import threading

import pytest

from corolla.server.core.refusals import RuntimeStopped
from corolla.server.core.runtime import Runtime, Task


class _Channel:
    """Collects results per step and counts flushes, as `DeviceChannel` does."""

    def __init__(self) -> None:
        self.results: dict[int, object] = {}
        self.flushes = 0
        self.flushed = threading.Event()
        self._changed = threading.Condition()

    def done(self, step: int, result: object, error: BaseException | None) -> None:
        self.results[step] = error if error is not None else result

    def flush(self) -> None:
        with self._changed:
            self.flushes += 1
            self.flushed.set()
            self._changed.notify_all()

    def wait_for_results(self, count: int, timeout_s: float) -> bool:
        """True once `count` steps have results (a batch's results are in before its flush)."""
        with self._changed:
            return self._changed.wait_for(lambda: len(self.results) >= count, timeout_s)


def _tasks(runtime: Runtime, channel: _Channel, steps: range, size_tokens: int = 1) -> list[Task]:
    return [
        runtime.task(
            lambda: None,
            on_done=lambda r, e, i=i: channel.done(i, r, e),
            flush=channel.flush,
            priority=1,
            size_tokens=size_tokens,
            kind="decode",
            merge_key="span",
            payload=i,
        )  # fmt: skip
        for i in steps
    ]


def test_a_frames_steps_run_in_one_batch_with_one_flush_per_channel() -> None:
    batches: list[list[int]] = []

    def executor(tasks: list[Task]) -> list[object]:
        batches.append([t.payload for t in tasks])  # type: ignore[misc]
        return [ValueError("refused") if t.payload == 3 else t.payload * 10 for t in tasks]  # type: ignore[operator]

    channels = [_Channel(), _Channel()]
    with Runtime(max_batch_size_tokens=64) as runtime:
        runtime.register_batch_executor("decode", executor)
        gate = threading.Event()
        runtime.queue(runtime.task(gate.wait, on_done=lambda r, e: None, priority=0, size_tokens=1))  # holds the thread
        runtime.queue(_tasks(runtime, channels[0], range(0, 4)))
        runtime.queue(_tasks(runtime, channels[1], range(4, 6)))
        gate.set()
        assert all(c.flushed.wait(5) for c in channels)
    assert batches == [[0, 1, 2, 3, 4, 5]]
    assert [c.flushes for c in channels] == [1, 1]  # each channel's bound `flush` is a new object per task
    assert channels[0].results[2] == 20 and isinstance(channels[0].results[3], ValueError)  # fails only its caller
    assert channels[1].results == {4: 40, 5: 50}


def test_a_kinds_merge_limit_bounds_each_batch_and_the_first_task_always_runs() -> None:
    batches: list[list[int]] = []

    def executor(tasks: list[Task]) -> list[object]:
        batches.append([t.payload for t in tasks])  # type: ignore[misc]
        return [None] * len(tasks)

    channel = _Channel()
    with Runtime(max_batch_size_tokens=64) as runtime:
        runtime.register_batch_executor("decode", executor, max_merged_tokens=2)
        with pytest.raises(ValueError, match="max_merged_tokens"):
            runtime.register_batch_executor("other", executor, max_merged_tokens=0)
        gate = threading.Event()
        runtime.queue(runtime.task(gate.wait, on_done=lambda r, e: None, priority=0, size_tokens=1))
        runtime.queue(_tasks(runtime, channel, range(0, 1), size_tokens=5))  # a prefill past the limit
        runtime.queue(_tasks(runtime, channel, range(1, 6)))
        gate.set()
        # (not `flushed.wait` in a loop: set by the first batch's flush, it returned at once for the later ones, and
        # a loaded machine stopped the runtime before the last batch ran)
        assert channel.wait_for_results(6, timeout_s=30)
    assert batches == [[0], [1, 2], [3, 4], [5]]


def test_a_stopped_runtime_refuses_a_frames_steps_as_a_whole() -> None:
    channel = _Channel()
    runtime = Runtime(max_batch_size_tokens=64)
    with runtime:
        tasks = _tasks(runtime, channel, range(3))
    with pytest.raises(RuntimeStopped):
        runtime.queue(tasks)
    with pytest.raises(RuntimeStopped):
        runtime.task(
            lambda: None, on_done=lambda r, e: None, flush=None, priority=1, size_tokens=1, kind="decode",
            merge_key=None, payload=None,
        )  # fmt: skip
    assert runtime.num_pending == 0 and channel.results == {}
    assert runtime.thread is not None and not runtime.thread.is_alive()


def test_a_steps_then_runs_in_the_delivery_that_resolves_it_and_nowhere_else() -> None:
    """`Task.then` runs with its resolved future inside the loop callback that delivers the batch, each task's right
    after its own future is set (a done callback would run once every future of the batch is set), a failing one
    without stopping the others; never for a future cancelled before, nor for a task that ran inline (its future
    comes back resolved)."""

    async def main() -> None:
        seen: list[tuple[int, object, bool]] = []  # (payload, result, whether the batch's last future was set yet)
        tasks: list[Task] = []

        def then(i: int, future: asyncio.Future) -> None:
            last = tasks[-1].future
            seen.append((i, future.result(), last is not None and last.done()))
            if i == 1:
                raise RuntimeError("a failing reply")

        with Runtime(max_batch_size_tokens=64) as runtime:
            runtime.register_batch_executor("decode", lambda ts: [t.payload * 10 for t in ts], inline_when_idle=True)
            gate = threading.Event()
            blocker = runtime.task(gate.wait, on_done=lambda r, e: None, priority=0, size_tokens=1)
            runtime.queue(blocker)  # holds the thread: the steps below merge into one batch
            for i in range(4):
                tasks.append(runtime.task(lambda: None, priority=1, size_tokens=1, kind="decode", merge_key="span",
                                          payload=i, then=functools.partial(then, i)))  # fmt: skip
                runtime.queue(tasks[-1])
            assert tasks[2].future is not None
            tasks[2].future.cancel()  # its caller gave up: its reply never runs
            gate.set()
            while not all(t.future is not None and t.future.done() for t in tasks):
                await asyncio.sleep(0.001)
            await asyncio.sleep(0.01)
            assert seen == [(0, 0, False), (1, 10, False), (3, 30, True)]
            seen.clear()
            lone = runtime.task(lambda: None, priority=1, size_tokens=1, kind="decode", merge_key="span", payload=5,
                                then=functools.partial(then, 5))  # fmt: skip
            runtime.queue(lone, inline=True)  # an idle runtime runs it here: resolved at once, its `then` not run
            assert lone.future is not None and lone.future.result() == 50
            await asyncio.sleep(0.01)
            assert seen == []

    asyncio.run(main())
