"""A device channel frame's decode steps travel as ONE runtime task (`server.handlers.device_channel.FrameIntake`,
`server.core.engine_executor.StepGroup`): each step still gets exactly its own output, a frame larger than one merged forward is
split at the merge limit, a refused step is answered at once and leaves the others in the task, a session closed
while its step waits fails that step only, a failing forward fails only its steps, and the runtime's counters count
steps, not tasks."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import AsyncIterator

import pytest
import torch
from tests.helpers.channel_frames import batch_payload

from corolla.engine import EngineConfig, SpanEngine
from corolla.engine.batcher import execute_steps
from corolla.engine.span_engine import StepRequest
from corolla.protocol import channel_frames as wire
from corolla.server.backend import SpanBackend
from corolla.server.core.engine_executor import (
    KIND_ENGINE_INFERENCE,
    EngineExecutor,
    EngineSessionCache,
    PendingUnits,
    StepGroup,
    flatten_units,
    regroup,
)
from corolla.server.core.executor import SessionCache, SessionSpec, StepInputs
from corolla.server.core.refusals import RuntimeStopped
from corolla.server.core.runtime import MAX_WATCHES, Runtime, Task, TaskQueue
from corolla.server.core.span_core import SpanCore
from corolla.server.core.step_rates import StepRates
from corolla.server.handlers.device_channel import FrameIntake, StepReply
from helpers.tiny_models import tiny_span_backend

H, SPAN, ROWS = 64, (0, 1), 8  # ROWS: the engine's largest forward (the merge limit of a decode batch)


@pytest.fixture(scope="module")
def backend() -> SpanBackend:
    return tiny_span_backend(SPAN)


class _Channel:
    """What a device channel gives the intake: its sessions by handle, an outbox, a flush counter."""

    def __init__(self) -> None:
        self.caches: dict[int, SessionCache] = {}
        self.replies: dict[int, torch.Tensor | BaseException] = {}
        self.flushes = 0
        self.lock = threading.Lock()

    def held(self, handle: int) -> tuple[SessionCache, None]:
        if handle not in self.caches:
            raise wire.FrameError(f"no open session with a cache under handle {handle}")
        return self.caches[handle], None

    def queue(self, replies: list[StepReply]) -> None:
        with self.lock:
            for request_id, result, _ in replies:
                self.replies[request_id] = result

    def flush(self) -> None:
        with self.lock:
            self.flushes += 1

    def wait_for(self, count: int) -> None:
        deadline = time.monotonic() + 20
        while len(self.replies) < count:
            assert time.monotonic() < deadline, f"{len(self.replies)} of {count} replies"
            time.sleep(0.002)


@contextlib.asynccontextmanager
async def _setup(
    backend: SpanBackend, sessions: int
) -> AsyncIterator[tuple[EngineExecutor, FrameIntake, _Channel, list[SessionCache]]]:
    with Runtime(max_batch_size_tokens=1024) as runtime:
        config = EngineConfig(kv_pool_bytes=1 << 21, page_size_tokens=16, max_seq_len_tokens=64, max_batch_rows=ROWS)
        real = EngineExecutor(backend, SpanEngine.from_blocks([backend.blocks[i] for i in SPAN], config), runtime)
        channel = _Channel()
        intake = FrameIntake(SpanCore(real), channel.held, channel.queue, channel.flush)
        async with contextlib.AsyncExitStack() as stack:
            caches = [
                await stack.enter_async_context(real.open_session(SessionSpec(SPAN, 1, 32), 0))
                for _ in range(2 * sessions)
            ]
            yield real, intake, channel, caches


def _frame(items: list[tuple[int, int, int, torch.Tensor]]) -> memoryview:
    """A STEP_BATCH payload of (request id, handle, prefix length, hidden [B, T, H]) items."""
    writers = [
        (wire.STEP, rid, wire.Writer().step_head(handle, pos, False, "").tensor(hidden).tensor(None).tensor(None))
        for rid, handle, pos, hidden in items
    ]
    return memoryview(b"".join(batch_payload(writers).parts))


async def _prefilled(real: EngineExecutor, caches: list[SessionCache]) -> None:
    torch.manual_seed(2)
    half = len(caches) // 2
    for i in range(half):  # session i and its twin i + half see the same prompt
        prompt = torch.randn(1, 3, H)
        for cache in (caches[i], caches[i + half]):
            await real.step(cache, StepInputs(prompt, 0, None, None, "", False))


async def _decode(real: EngineExecutor, intake: FrameIntake, channel: _Channel, caches: list[SessionCache],
                  rows: list[torch.Tensor], extra: list[tuple[int, int, int, torch.Tensor]] = ()) -> None:  # fmt: skip
    """Steps sessions 0..n-1 through one frame (handles 1..n, plus `extra` items), twins n.. directly (the
    reference, kept in channel.replies under request id 1000 + i)."""
    n = len(rows)
    for i in range(n):
        channel.caches[i + 1] = caches[i]
    items = [(i + 1, i + 1, 3, rows[i]) for i in range(n)] + list(extra)
    intake.submit(wire.STEP_BATCH, 0, _frame(items))
    channel.wait_for(len(items))
    for i in range(n):
        channel.replies[1000 + i] = await real.step(caches[n + i], StepInputs(rows[i], 3, None, None, "", False))


def _tasks(runtime: Runtime) -> tuple[int, int]:
    stats = runtime.stats().get(KIND_ENGINE_INFERENCE)
    return (stats.batches, stats.tasks) if stats is not None else (0, 0)


async def test_a_frames_decode_steps_are_one_task_and_each_gets_its_own_output(backend) -> None:
    n = 6
    async with _setup(backend, n) as (real, intake, channel, caches):
        await _prefilled(real, caches)
        batches, steps = _tasks(real.runtime)
        observed: list[int] = []
        real.runtime.add_batch_observer(lambda kind, num_steps, s: observed.append(num_steps))
        await _decode(real, intake, channel, caches, [torch.randn(1, 1, H) for _ in range(n)])
        assert intake.num_frame_tasks == 1
        assert observed[0] == n  # one batch of the frame's n steps (the twins' steps come after it)
        assert _tasks(real.runtime)[0] - batches >= 1 and _tasks(real.runtime)[1] - steps == 2 * n  # steps counted
        for i in range(n):
            torch.testing.assert_close(channel.replies[i + 1], channel.replies[1000 + i], rtol=1e-5, atol=1e-5)
        assert channel.flushes >= 1


async def test_a_frame_past_the_merge_limit_is_split_into_tasks_that_fit(backend) -> None:
    n = ROWS + 4
    async with _setup(backend, n) as (real, intake, channel, caches):
        await _prefilled(real, caches)
        assert real.runtime.merge_limit(KIND_ENGINE_INFERENCE) == ROWS
        sizes: list[int] = []
        real.runtime.add_batch_observer(lambda kind, num_steps, s: sizes.append(num_steps))
        await _decode(real, intake, channel, caches, [torch.randn(1, 1, H) for _ in range(n)])
        assert intake.num_frame_tasks == 2
        assert sizes[:2] == [ROWS, 4]  # the second part waits for the next forward
        for i in range(n):
            torch.testing.assert_close(channel.replies[i + 1], channel.replies[1000 + i], rtol=1e-5, atol=1e-5)


async def test_refused_steps_are_answered_at_once_and_the_others_run(backend) -> None:
    n = 4
    async with _setup(backend, n) as (real, intake, channel, caches):
        await _prefilled(real, caches)
        extra = [(50, 999, 3, torch.randn(1, 1, H)), (51, 1, 4, torch.randn(1, 1, H + 1))]  # no session; bad width
        await _decode(real, intake, channel, caches, [torch.randn(1, 1, H) for _ in range(n)], extra)
        assert isinstance(channel.replies[50], wire.FrameError) and "handle 999" in str(channel.replies[50])
        assert isinstance(channel.replies[51], ValueError)
        assert intake.num_frame_tasks == 1
        for i in range(n):
            torch.testing.assert_close(channel.replies[i + 1], channel.replies[1000 + i], rtol=1e-5, atol=1e-5)


async def test_a_session_closed_while_its_step_waits_fails_that_step_only(backend) -> None:
    n = 3
    async with _setup(backend, n) as (real, intake, channel, caches):
        await _prefilled(real, caches)
        release = threading.Event()
        real.runtime.queue(real.runtime.task(release.wait, on_done=lambda r, e: None, priority=0.0, size_tokens=1))
        for i in range(n):
            channel.caches[i + 1] = caches[i]
        rows = [torch.randn(1, 1, H) for _ in range(n)]
        intake.submit(wire.STEP_BATCH, 0, _frame([(i + 1, i + 1, 3, rows[i]) for i in range(n)]))
        closed = caches[1]
        assert isinstance(closed, EngineSessionCache)
        closed.session.close()  # evicted while its step is queued inside the frame's task
        release.set()
        channel.wait_for(n)
        assert isinstance(channel.replies[2], ValueError)
        for i in (0, 2):
            want = await real.step(caches[n + i], StepInputs(rows[i], 3, None, None, "", False))
            torch.testing.assert_close(channel.replies[i + 1], want, rtol=1e-5, atol=1e-5)


async def test_a_failing_forward_fails_only_its_frames_steps(backend, monkeypatch) -> None:
    n = 3
    async with _setup(backend, 2 * n) as (real, intake, channel, caches):
        await _prefilled(real, caches)
        engine = real.engine
        decode_many = engine.decode_many
        calls: list[int] = []

        def failing_once(reqs: list[StepRequest], **kwargs: object) -> list[torch.Tensor]:
            calls.append(len(reqs))
            if len(calls) == 1:
                raise RuntimeError("device fault")
            return decode_many(reqs, **kwargs)  # type: ignore[arg-type]

        monkeypatch.setattr(engine, "decode_many", failing_once)
        for i in range(2 * n):
            channel.caches[i + 1] = caches[i]
        rows = [torch.randn(1, 1, H) for _ in range(2 * n)]
        intake.submit(wire.STEP_BATCH, 0, _frame([(i + 1, i + 1, 3, rows[i]) for i in range(n)]))
        channel.wait_for(n)
        assert all(isinstance(channel.replies[i + 1], RuntimeError) for i in range(n))
        intake.submit(wire.STEP_BATCH, 1, _frame([(i + 1, i + 1, 3, rows[i]) for i in range(n, 2 * n)]))
        channel.wait_for(2 * n)
        for i in range(n, 2 * n):
            want = await real.step(caches[2 * n + i], StepInputs(rows[i], 3, None, None, "", False))
            torch.testing.assert_close(channel.replies[i + 1], want, rtol=1e-5, atol=1e-5)


def test_runtime_counters_and_the_gather_count_steps_not_tasks() -> None:
    done = threading.Event()
    got: list[object] = []

    def merged(tasks: list[Task]) -> list[object]:
        return [t.payload for t in tasks]

    with Runtime(max_batch_size_tokens=64) as runtime:
        runtime.register_batch_executor("k", merged)
        observed: list[int] = []
        runtime.add_batch_observer(lambda kind, num_steps, s: observed.append(num_steps))
        tasks = [
            runtime.task(
                lambda: None,
                on_done=lambda r, e: got.append(r),
                flush=done.set,
                priority=1.0,
                size_tokens=size,
                kind="k",
                merge_key="m",
                payload=size,
                steps=size,
            )  # fmt: skip
            for size in (5, 3)
        ]
        pushed = runtime._queue.num_pushed
        runtime.queue(tasks)
        assert done.wait(10)
        assert runtime._queue.num_pushed - pushed == 8
    assert sorted(got) == [3, 5] and observed == [8]
    assert runtime.num_tasks_done == 8 and runtime.stats()["k"].tasks == 8 and runtime.stats()["k"].batches == 1


def test_the_queue_counts_each_steps_session_back_for_the_forward_that_held_it() -> None:
    queue = TaskQueue()

    def task(sessions: tuple[int, ...], at: float) -> Task:
        return Task(
            fn=lambda: None, priority=1.0, size_tokens=len(sessions), future=None, loop=None, submitted_at=at,
            steps=len(sessions), sessions=sessions,
        )  # fmt: skip

    queue.watch({1, 2, 3, 4}, 3, 5.0)  # a forward of sessions 1-4 finished at 5.0: 3 of them waited for
    queue.watch({5, 6}, 2, 6.0)
    queue.push(task((1, 9), 10.0))  # a frame of two steps: session 9 was in no watched forward
    assert queue.take_returns() == ([], None)
    queue.push_many([task((2, 5), 20.0), task((3,), 30.0)])
    assert queue.num_pushed == 5
    assert queue.take_returns() == ([(5.0, 30.0)], None)  # the third of 1-4 back at 30.0; 5-6 still watched
    queue.push(task((6,), 40.0))
    assert queue.take_returns() == ([(6.0, 40.0)], None)
    for i in range(MAX_WATCHES + 1):  # sessions that never come back: the oldest watch is dropped, how long it waited
        queue.watch({100 + i}, 1, 50.0 + i)
    assert queue.take_returns() == ([], float(MAX_WATCHES))


def test_units_flatten_and_regroup_in_order() -> None:
    a, b, c, d = (object() for _ in range(4))
    requests: list[object] = [a, b, c, d]
    units = [requests[0], StepGroup(requests[1:3]), requests[3]]  # type: ignore[list-item]
    flat, sizes = flatten_units(units)  # type: ignore[arg-type]
    assert flat == requests and sizes == [0, 2, 0]
    error = ValueError("refused")
    assert regroup([1, error, 3, 4], sizes) == [1, [error, 3], 4]  # type: ignore[list-item]
    assert flatten_units([a, b])[1] is None  # type: ignore[list-item]
    with pytest.raises(RuntimeError, match="step results"):
        regroup([1, 2], sizes)  # type: ignore[list-item]


async def test_a_step_group_alone_runs_as_execute_steps_merges_it(backend) -> None:
    async with _setup(backend, 2) as (real, _, _, caches):
        await _prefilled(real, caches)
        rows = [torch.randn(1, 1, H) for _ in range(2)]
        group = StepGroup([StepRequest(c.session, r, 3) for c, r in zip(caches[:2], rows, strict=True)])  # type: ignore[attr-defined]
        twins = [StepRequest(c.session, r, 3) for c, r in zip(caches[2:], rows, strict=True)]  # type: ignore[attr-defined]
        got = await real.runtime.submit(group.run, priority=1.0, size_tokens=2)
        want = await real.runtime.submit(lambda: execute_steps(real.engine, twins), priority=1.0, size_tokens=2)
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w)


async def test_stop_fails_every_step_of_a_queued_frame_task(backend) -> None:
    runtime = Runtime(max_batch_size_tokens=1024)  # never started: the frame's task stays queued
    config = EngineConfig(kv_pool_bytes=1 << 21, page_size_tokens=16, max_seq_len_tokens=64, max_batch_rows=ROWS)
    real = EngineExecutor(backend, SpanEngine.from_blocks([backend.blocks[i] for i in SPAN], config), runtime)
    channel = _Channel()
    intake = FrameIntake(SpanCore(real), channel.held, channel.queue, channel.flush)
    async with contextlib.AsyncExitStack() as stack:
        for handle in (1, 2, 3):
            channel.caches[handle] = await stack.enter_async_context(real.open_session(SessionSpec(SPAN, 1, 32), 0))
        intake.submit(wire.STEP_BATCH, 0, _frame([(h, h, 0, torch.randn(1, 1, H)) for h in (1, 2, 3)]))
        assert intake.num_frame_tasks == 1 and runtime.num_pending == 1 and not channel.replies
        runtime.stop()
        assert sorted(channel.replies) == [1, 2, 3]
        assert all(isinstance(r, RuntimeStopped) for r in channel.replies.values())
        flushes = channel.flushes
        intake.submit(wire.STEP_BATCH, 1, _frame([(4, 1, 0, torch.randn(1, 1, H)), (5, 2, 0, torch.randn(1, 1, H))]))
        assert isinstance(channel.replies[4], RuntimeStopped) and isinstance(channel.replies[5], RuntimeStopped)
        assert channel.flushes == flushes + 1  # a later frame is refused step by step, at once, in one flush


class _Launched:
    def __init__(self, results: list[object], device_s: float | None = None) -> None:
        self.results = results
        self.device_s = device_s

    def wait(self) -> list[object]:
        return self.results


def test_a_launched_batch_of_units_is_handed_back_per_unit_and_its_decode_rate_recorded() -> None:
    error = ValueError("closed")
    rates = StepRates()
    for _ in range(3):
        pending = PendingUnits(_Launched([1, 2, error, 4], device_s=0.004), [2, 0, 1], rates, 4, 2)  # type: ignore[arg-type]
        assert pending.wait() == [[1, 2], error, [4]]
    assert rates.announced()["inference_rps"] == pytest.approx(2 / 0.004, rel=0.1)  # 2 blocks in 4 ms a step


async def test_a_frames_steps_reach_the_executor_as_bytes_without_a_tensor(backend: SpanBackend) -> None:
    async with _setup(backend, 2) as (real, intake, channel, caches):
        await _prefilled(real, caches)
        seen: list[tuple[StepInputs, bool]] = []  # the inputs, and whether the request had no tensor when queued
        prepare = real.prepare_step

        def spy(cache: SessionCache, inputs: StepInputs):
            request = prepare(cache, inputs)
            assert isinstance(request, StepRequest)
            seen.append((inputs, request.hidden_tensor is None))
            return request

        real.prepare_step = spy  # type: ignore[method-assign]
        torch.manual_seed(5)
        rows = [torch.randn(1, 1, H) for _ in range(2)]
        await _decode(real, intake, channel, caches, rows)
        assert len(seen) == 4  # the frame's two steps, then their twins stepped directly
        assert [no_tensor for _, no_tensor in seen] == [True, True, False, False]  # checked, queued from bytes
        for (inputs, _), row in zip(seen[:2], rows, strict=True):
            assert inputs.hidden_states is None and inputs.hidden_meta == (torch.float32, (1, 1, H))
            assert torch.equal(inputs.tensor(), row)  # built on demand, equal to what the client sent
        for i in range(2):  # and each step's output equals its twin's, stepped directly with a tensor
            torch.testing.assert_close(channel.replies[i + 1], channel.replies[1000 + i], rtol=1e-5, atol=1e-5)


def test_step_inputs_give_a_tensor_from_bytes_or_refuse_without_either() -> None:
    row = torch.randn(2, 1, 4)  # [B, T, H]
    raw = memoryview(bytearray(row.numpy().tobytes()))
    inputs = StepInputs(None, 0, None, None, "", False, raw, (torch.float32, (2, 1, 4)))
    assert torch.equal(inputs.tensor(), row)
    empty = StepInputs(None, 0, None, None, "", False, memoryview(bytearray()), (torch.float32, (2, 0, 4)))
    assert empty.tensor().shape == (2, 0, 4)
    with pytest.raises(ValueError, match="needs its hidden states"):
        StepInputs(None, 0, None, None, "", False).tensor()
    with pytest.raises(ValueError, match="needs its hidden states"):
        StepRequest(None, None, 0)  # type: ignore[arg-type]


def _steps_task(steps: int) -> Task:
    """A task carrying `steps` sessions' steps."""
    return Task(fn=lambda: None, priority=1.0, size_tokens=steps, future=None, loop=None, steps=steps)


def test_pushes_short_of_what_the_runtime_waits_for_do_not_wake_it() -> None:
    # the runtime thread waiting for a cohort's steps (`wait_for_pushes`) is woken once they are all there, not by
    # every frame on the way (each wake-up costs both threads a GIL hand-off); a pop waiter is woken by any push
    queue = TaskQueue()

    waiter = threading.Thread(target=queue.wait_for_pushes, args=(8, 10.0))
    waiter.start()
    deadline = time.monotonic() + 5
    while queue._wanted != 8:
        assert time.monotonic() < deadline
        time.sleep(0.001)
    queue.push_many([_steps_task(3)])
    queue.push(_steps_task(1))
    assert queue.num_wakeups == 0 and waiter.is_alive()
    queue.push_many([_steps_task(4)])  # 8 in all: wakes it
    waiter.join(5)
    assert not waiter.is_alive() and queue.num_wakeups == 1
    queue.push(_steps_task(1))  # nobody waits for a count: any push notifies
    assert queue.num_wakeups == 2
    assert len(queue.pop_batch(max_batch_tokens=100, mergeable_kinds=(), timeout_s=0)) == 1


class _CountingCondition(threading.Condition):
    """Counts the waits its waiter starts: one more each time it was woken and waits again."""

    waits = 0

    def wait(self, timeout: float | None = None) -> bool:
        self.waits += 1
        return super().wait(timeout)


def test_the_loops_deferred_wake_short_of_what_the_runtime_waits_for_does_not_wake_it() -> None:
    # a front's steps are pushed without a notification and the loop wakes the device thread once per iteration
    # (`Runtime.queue` -> `TaskQueue.wake`): that wake obeys the count `wait_for_pushes` waits for, as a push's does
    # (before, every loop iteration with a step woke the gathering device thread: a futex wake for the loop and a
    # GIL hand-off for both threads per iteration, ~12% of one front's loop at 16 sessions on the dev VM)
    queue = TaskQueue()
    condition = queue._cond = _CountingCondition(queue._lock)  # (the queue holds its lock with `with queue._lock`)

    waiter = threading.Thread(target=queue.wait_for_pushes, args=(3, 10.0))
    waiter.start()
    deadline = time.monotonic() + 5
    while condition.waits != 1:
        assert time.monotonic() < deadline
        time.sleep(0.001)
    for _ in range(2):
        queue.push(_steps_task(1), notify=False)
        queue.wake()
    time.sleep(0.05)  # time enough for a woken waiter to wait again
    assert condition.waits == 1 and waiter.is_alive() and queue.num_wakeups == 0
    queue.push(_steps_task(1), notify=False)
    queue.wake()  # 3 in all: wakes it
    waiter.join(5)
    assert not waiter.is_alive() and condition.waits == 1 and queue.num_wakeups == 1


@pytest.mark.parametrize("shape", [(1, 1, H), (2, 3, H)])
def test_a_request_of_bytes_is_the_request_the_constructor_builds(shape: tuple[int, int, int]) -> None:
    import dataclasses

    from corolla.utils.tensor_bytes import HiddenRows

    data = memoryview(bytearray(2 * shape[0] * shape[1] * H * 4))
    raw = data[: len(data) // 2]
    rows = (HiddenRows(data, torch.float32, shape, 2), 0)
    session = object()
    for hidden_rows in (None, rows):
        fast = StepRequest.of_bytes(session, 5, raw, torch.float32, shape, hidden_rows)  # type: ignore[arg-type]
        ref = StepRequest(session, None, 5, hidden_bytes=raw, hidden_dtype=torch.float32, hidden_shape=shape,  # type: ignore[arg-type]
                          hidden_rows=hidden_rows)  # fmt: skip
        for f in dataclasses.fields(StepRequest):  # every field, those added later included
            assert getattr(fast, f.name) == getattr(ref, f.name), f.name
        assert torch.equal(fast.hidden, ref.hidden)
