"""Runtime: one device thread running tasks by priority, failures isolated, pending tasks failed on stop."""

from __future__ import annotations

import asyncio
import itertools
import random
import threading

import pytest

from corolla.server.core.refusals import RuntimeStopped
from corolla.server.core.runtime import PRIORITY_FORWARD, PRIORITY_INFERENCE, Runtime, Task, TaskQueue


async def _block_runtime(runtime: Runtime) -> tuple[threading.Event, asyncio.Future]:
    """Occupies the device thread until the returned event is set, so that later submissions queue up."""
    started, gate = threading.Event(), threading.Event()

    def blocker() -> str:
        started.set()
        gate.wait(10)
        return "blocker"

    future = runtime.submit(blocker, priority=0, size_tokens=1)
    assert await asyncio.to_thread(started.wait, 5)
    return gate, future


async def test_runs_by_priority_then_submission_time() -> None:
    order: list[str] = []
    with Runtime(max_batch_size_tokens=100) as runtime:
        gate, blocker = await _block_runtime(runtime)
        submitted = [
            ("forward-1", PRIORITY_FORWARD),
            ("inference-1", PRIORITY_INFERENCE),
            ("forward-2", PRIORITY_FORWARD),
            ("inference-2", PRIORITY_INFERENCE),
            ("urgent", 0.5),
            ("inference-3", PRIORITY_INFERENCE),
        ]
        futures = [
            runtime.submit(lambda name=name: order.append(name) or name, priority=priority, size_tokens=1)
            for name, priority in submitted
        ]
        assert runtime.num_pending == len(submitted)
        gate.set()
        results = await asyncio.wait_for(asyncio.gather(blocker, *futures), 10)
    assert results == ["blocker"] + [name for name, _ in submitted]
    assert order == ["urgent", "inference-1", "inference-2", "inference-3", "forward-1", "forward-2"]


async def test_tasks_run_in_one_thread_and_results_return_to_the_loop() -> None:
    with Runtime(max_batch_size_tokens=10) as runtime:
        thread_names = await asyncio.gather(
            *[runtime.submit(lambda: threading.current_thread().name, priority=1, size_tokens=1) for _ in range(20)]
        )
    assert set(thread_names) == {runtime.name}
    assert runtime.name != threading.current_thread().name


async def test_failing_task_reports_to_its_caller_and_the_loop_goes_on() -> None:
    def broken() -> None:
        raise ValueError("bad input: limit is 3")

    with Runtime(max_batch_size_tokens=10) as runtime:
        bad = runtime.submit(broken, priority=1, size_tokens=1)
        good = runtime.submit(lambda: 42, priority=1, size_tokens=1)
        with pytest.raises(ValueError, match="limit is 3"):
            await asyncio.wait_for(bad, 5)
        assert await asyncio.wait_for(good, 5) == 42
        assert await asyncio.wait_for(runtime.submit(lambda: "still alive", priority=2, size_tokens=1), 5) == (
            "still alive"
        )
        assert runtime.is_running


async def test_oversized_task_is_rejected_naming_the_limit() -> None:
    with Runtime(max_batch_size_tokens=64) as runtime:
        with pytest.raises(ValueError, match="max_batch_size of 64 tokens"):
            runtime.submit(lambda: None, priority=1, size_tokens=65)
        assert await runtime.submit(lambda: "fits", priority=1, size_tokens=64) == "fits"


async def test_stop_fails_pending_tasks_and_refuses_new_ones() -> None:
    runtime = Runtime(max_batch_size_tokens=10)
    runtime.start()
    gate, blocker = await _block_runtime(runtime)
    pending = [runtime.submit(lambda: "never", priority=1, size_tokens=1) for _ in range(3)]
    stopper = asyncio.get_running_loop().run_in_executor(None, runtime.stop)
    await asyncio.sleep(0.05)
    gate.set()  # the running task finishes normally
    await asyncio.wait_for(stopper, 10)
    assert await asyncio.wait_for(blocker, 5) == "blocker"
    for future in pending:
        with pytest.raises(RuntimeStopped, match="stopped before this task ran"):
            await asyncio.wait_for(future, 5)
    with pytest.raises(RuntimeError, match="stopped"):
        runtime.submit(lambda: None, priority=1, size_tokens=1)
    assert not runtime.is_running


async def test_cancelled_task_is_skipped() -> None:
    ran: list[str] = []
    with Runtime(max_batch_size_tokens=10) as runtime:
        gate, blocker = await _block_runtime(runtime)
        skipped = runtime.submit(lambda: ran.append("skipped"), priority=1, size_tokens=1)
        kept = runtime.submit(lambda: ran.append("kept"), priority=1, size_tokens=1)
        skipped.cancel()
        gate.set()
        await asyncio.wait_for(asyncio.gather(blocker, kept), 5)
    assert ran == ["kept"]


async def test_tasks_with_a_merge_key_run_together_through_the_batch_executor() -> None:
    batches: list[list[int]] = []

    def executor(tasks):
        batches.append([t.payload for t in tasks])
        return [ValueError("odd") if t.payload % 2 else t.payload * 10 for t in tasks]

    with Runtime(max_batch_size_tokens=3) as runtime:
        runtime.register_batch_executor("decode", executor)
        gate, blocker = await _block_runtime(runtime)
        futures = [
            runtime.submit(
                lambda i=i: ("solo", i), priority=1, size_tokens=1, kind="decode", merge_key="span", payload=i
            )
            for i in range(5)
        ]
        other = runtime.submit(lambda: "solo", priority=1, size_tokens=1, kind="decode", merge_key="x", payload=100)
        unkeyed = runtime.submit(lambda: "no merge key", priority=1, size_tokens=1, kind="decode")
        gate.set()
        await blocker
        results = await asyncio.wait_for(asyncio.gather(*futures, other, unkeyed, return_exceptions=True), 5)
    # the token limit (3) splits the five tasks into two merged batches; the other merge key is a batch of one;
    # a task without a merge key runs alone as fn()
    assert batches == [[0, 1, 2], [3, 4], [100]]
    assert results[0] == 0 and results[2] == 20 and results[4] == 40
    assert isinstance(results[1], ValueError) and isinstance(results[3], ValueError)
    assert results[5] == 1000 and results[6] == "no merge key"


async def test_a_failing_batch_executor_fails_only_its_batch() -> None:
    def executor(tasks):
        raise RuntimeError("device error in merged step")

    with Runtime(max_batch_size_tokens=8) as runtime:
        runtime.register_batch_executor("decode", executor)
        gate, blocker = await _block_runtime(runtime)
        merged = [
            runtime.submit(lambda: None, priority=1, size_tokens=1, kind="decode", merge_key="span") for _ in range(3)
        ]
        after = runtime.submit(lambda: "ok", priority=2, size_tokens=1)
        gate.set()
        await blocker
        results = await asyncio.wait_for(asyncio.gather(*merged, return_exceptions=True), 5)
        assert all(isinstance(r, RuntimeError) and "merged step" in str(r) for r in results)
        assert await asyncio.wait_for(after, 5) == "ok"
        assert runtime.num_batches_done >= 3  # blocker, the merged batch, `after`


def _thread_name_executor(tasks: list) -> list:
    return [(task.payload, threading.current_thread().name) for task in tasks]


async def test_lone_short_step_runs_inline_when_idle_and_queues_otherwise() -> None:
    from corolla.server.core.runtime import INLINE_MAX_TOKENS

    here = threading.current_thread().name
    with Runtime(max_batch_size_tokens=1000) as runtime:
        runtime.register_batch_executor("decode", _thread_name_executor, inline_when_idle=True)
        runtime.register_batch_executor("plain", _thread_name_executor)

        def step(payload: str, *, kind: str = "decode", inline: bool = True, size: int = 1) -> asyncio.Future:
            return runtime.submit(
                lambda: None, priority=1, size_tokens=size, kind=kind, merge_key="k", payload=payload, inline=inline
            )

        future = step("idle")  # idle runtime: ran right here, already resolved
        assert future.done() and future.result() == ("idle", here)
        assert runtime.num_inline_batches == 1
        # not asked, a kind not registered for it, or a long prefill: the device thread runs them
        for f in (step("no", inline=False), step("plain", kind="plain"), step("long", size=INLINE_MAX_TOKENS + 1)):
            assert (await asyncio.wait_for(f, 5))[1] == runtime.name
        # a busy runtime (or queued work) never lets a step jump the queue
        gate, blocker = await _block_runtime(runtime)
        queued = step("busy")
        assert not queued.done() and runtime.num_pending == 1
        gate.set()
        assert (await asyncio.wait_for(queued, 5)) == ("busy", runtime.name)
        await blocker
        assert runtime.num_inline_batches == 1


async def test_failing_inline_step_reports_to_its_caller() -> None:
    def failing(tasks: list) -> list:
        raise ValueError("bad step")

    with Runtime(max_batch_size_tokens=10) as runtime:
        runtime.register_batch_executor("decode", failing, inline_when_idle=True)
        future = runtime.submit(lambda: None, priority=1, size_tokens=1, kind="decode", merge_key="k", inline=True)
        assert future.done()
        with pytest.raises(ValueError, match="bad step"):
            await future
        assert await runtime.submit(lambda: "still serving", priority=1, size_tokens=1) == "still serving"


def test_push_and_push_many_queue_by_the_tasks_sort_key() -> None:
    """`TaskQueue.push` builds its heap entry inline (a push per decode step) and `push_many` through `Task.sort_key`:
    whichever queued them, the most urgent task is the one with the lowest `sort_key` (priority, then the time it
    ranks at: `ranks_at`, a held task's lead time, else its queueing; then the order of pushes)."""
    rng = random.Random(0)
    for trial in range(200):
        tasks = []
        for i in range(rng.randint(1, 6)):
            task = Task(lambda: None, float(rng.choice([0, 1, 2])), 1, None, None, kind=f"t{trial}.{i}",
                        submitted_at=rng.choice([10.0, 20.0, 30.0]))  # fmt: skip
            task.lead_after = rng.choice([0.0, 0.0, 15.0, 25.0])
            task.ranks_at = rng.choice([0.0, 0.0, 5.0, 35.0])
            tasks.append(task)
        one_by_one, at_once = TaskQueue(), TaskQueue()
        for task in tasks:
            one_by_one.push(task, notify=False)
        expected = min(tasks, key=lambda task: task.sort_key).kind
        assert one_by_one.head_kind() == expected, [task.sort_key for task in tasks]
        for task, seq in zip(tasks, itertools.count(1)):
            assert task.seq == seq
        at_once.push_many(tasks)
        assert at_once.head_kind() == expected
