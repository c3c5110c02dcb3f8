"""A shadow session's steps on a server (`protocol.shadow`, `EngineExecutor.step_task(..., shadow=True)`): each ranks
as a real step queued `runtime.SHADOW_LEAD_AFTER_S` after it (`Task.lead_after`), so that a merged batch takes it
only where the real steps queued before then left room; a shadow's decode row merges into the real sessions' forward
(a spare row), and so do a shadow's steps of several positions, as that many rows (the same outputs as a real
session's steps); a shadow's step that cannot ride (deep prompts) runs in a batch of its own; on an idle runtime a shadow's step waits its lead
time for a real step to ride with (and runs alone after it), unless no real step came for as long (then at once);
once its lead time has passed it goes ahead of the real steps queued after then (a shadow's prefill chunk, which no
real forward takes, ran only once real sessions in a closed loop were done, and its decode rows rode none of their
forwards), but at a full forward one aged shadow request at most goes ahead of real steps, the others take only the
rows left (a burst of aged requests took every row of a full replica's forwards); the mark reaches the device process of a server with handler processes; anything but a bool is refused at
the session's open."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time

import pytest
import torch
from tests.unit.test_executor_contract import SPAN, backend, eager_executor, make_executor, proxied_executor  # noqa: F401  (a fixture)

from corolla.engine import EngineConfig, SpanEngine
from corolla.protocol.shadow import SHADOW_KEY, parse_shadow
from corolla.server.core import engine_executor
from corolla.server.core.engine_executor import EngineExecutor
from corolla.server.core.executor import SessionOpen, SessionSpec, StepInputs
from corolla.server.core.runtime import (
    KIND_GENERIC,
    PRIORITY_FORWARD,
    PRIORITY_INFERENCE,
    SHADOW_LEAD_AFTER_S,
    Runtime,
    Task,
    TaskQueue,
)
from corolla.server.handlers.remote_core import RemoteCore
from corolla.server.metrics import ServerMetrics

H = 64


async def _prefill(executor, cache, tokens: int) -> None:
    await executor.step(cache, StepInputs(torch.randn(1, tokens, H), 0, None, None, "", lone_session=False))


async def _order_of_a_held_queue(backend, max_batch_rows: int, reals_in_s: float = 0.0) -> tuple[list[str], list[int]]:  # noqa: F811
    """Two real sessions and two shadows, each prefilled; then, while the runtime runs a held task, the shadows queue
    a decode step and a 2-token step BEFORE the real sessions queue their decode steps: at once (within the shadows'
    lead time, here 0.1 s: a loaded machine's pause between them cannot pass it), or `reals_in_s` later. -> (the
    order the steps completed in, the steps of each batch after the held one)."""
    with pytest.MonkeyPatch.context() as patch, Runtime(max_batch_size_tokens=1024) as runtime:
        config = EngineConfig(kv_pool_bytes=1 << 20, page_size_tokens=16, max_seq_len_tokens=64,
                              max_batch_rows=max_batch_rows)  # fmt: skip
        engine = SpanEngine.from_blocks([backend.blocks[i] for i in SPAN], config, fused=False)
        executor = EngineExecutor(backend, engine, runtime, ServerMetrics())
        specs = {"R1": SessionSpec(SPAN, 1, 32), "R2": SessionSpec(SPAN, 1, 32),
                 "S1": SessionSpec(SPAN, 1, 32, shadow=True), "S2": SessionSpec(SPAN, 1, 32, shadow=True)}  # fmt: skip
        async with contextlib.AsyncExitStack() as stack:
            caches = {name: await stack.enter_async_context(executor.open_session(spec, None))
                      for name, spec in specs.items()}  # fmt: skip
            for cache in caches.values():
                await _prefill(executor, cache, 4)
            patch.setattr(engine_executor, "SHADOW_LEAD_AFTER_S", 0.1)
            release = threading.Event()
            held = runtime.submit(release.wait, priority=0.0, size_tokens=1, kind=KIND_GENERIC)
            await asyncio.sleep(0.05)  # the runtime thread runs the held task
            batches: list[int] = []
            runtime.add_batch_observer(lambda kind, steps, seconds: batches.append(steps))
            done: list[str] = []

            async def step(name: str, tokens: int) -> None:
                inputs = StepInputs(torch.randn(1, tokens, H), 4, None, None, "", lone_session=False)
                await executor.step(caches[name], inputs)
                done.append(name)

            tasks = [asyncio.ensure_future(step(name, tokens)) for name, tokens in (("S1", 1), ("S2", 2))]
            await asyncio.sleep(reals_in_s)
            tasks += [asyncio.ensure_future(step(name, tokens)) for name, tokens in (("R1", 1), ("R2", 1))]
            await asyncio.sleep(0.05)  # all four queued
            release.set()
            await held
            await asyncio.gather(*tasks)
    return done, batches[1:]  # (the first: the held task)


async def test_shadow_rows_and_a_shadows_short_step_merge_into_the_real_forward(backend) -> None:  # noqa: F811
    done, batches = await _order_of_a_held_queue(backend, max_batch_rows=8)
    # one forward for the real rows, the shadow's decode row and the other shadow's 2-token step as two more rows
    # (before: that step ran in a batch of its own after it, a forward per shadow request of several positions)
    assert batches == [4], batches
    assert sorted(done) == ["R1", "R2", "S1", "S2"], done


@pytest.mark.parametrize("fused", [False, True])
async def test_a_shadows_positions_ride_as_rows_and_equal_a_real_sessions_steps(backend, fused: bool) -> None:  # noqa: F811
    """A shadow's step of several positions runs as that many rows of the merged decode forward (the engine's
    `decode_many`, with a real session's decode row), and computes what a real session's prompt and single-token
    steps over the same inputs compute; its cache then continues as the real one's."""
    torch.manual_seed(4)
    inputs = torch.randn(1, 12, H)
    with Runtime(max_batch_size_tokens=1024) as runtime:
        executor = make_executor(backend, runtime, fused=fused)
        decoded: list[list[int]] = []
        decode_many = executor.engine.decode_many

        def spying(reqs, **kw):
            decoded.append([r.num_tokens for r in reqs])
            return decode_many(reqs, **kw)

        executor.engine.decode_many = spying  # type: ignore[method-assign]
        async with (
            executor.open_session(SessionSpec(SPAN, 1, 32), None) as real,
            executor.open_session(SessionSpec(SPAN, 1, 32), None) as other,
            executor.open_session(SessionSpec(SPAN, 1, 32, shadow=True), None) as shadow,
        ):

            def step(cache, start: int, end: int, hidden=inputs):
                return executor.step(cache, StepInputs(hidden[:, start:end], start, None, None, "", lone_session=False))

            expected = [await step(real, 0, 4)] + [await step(real, t, t + 1) for t in range(4, 11)]
            await step(other, 0, 8)
            decoded.clear()
            got = [await step(shadow, 0, 4)]  # (alone: nothing real queued)
            # (the real row goes first, at position 8: the eager span runs the rows by position all the same)
            got += await asyncio.gather(step(shadow, 4, 11), step(other, 8, 9))
            assert [sorted(d) for d in decoded] == [[4], [1, 7]], decoded  # the 7 positions rode with the real row
            assert torch.allclose(torch.cat(got[:2], dim=1), torch.cat(expected, dim=1), atol=1e-4)
            last_real, last_shadow = await asyncio.gather(step(real, 11, 12), step(shadow, 11, 12))
            assert torch.allclose(last_shadow, last_real, atol=1e-4)


async def test_real_steps_go_first_where_the_forward_has_no_room_for_shadows(backend) -> None:  # noqa: F811
    done, batches = await _order_of_a_held_queue(backend, max_batch_rows=2)
    # the shadows queued first, yet the real steps queued within their lead time take the forward's two rows (ranked
    # by their queueing, the oldest steps, the shadows', would)
    assert done[:2] == ["R1", "R2"], done
    assert batches[0] == 2, batches


async def test_shadow_steps_past_their_lead_time_go_ahead_of_the_real_steps_queued_after_it(backend) -> None:  # noqa: F811
    done, batches = await _order_of_a_held_queue(backend, max_batch_rows=2, reals_in_s=0.15)
    # the shadows waited past their lead time before the real steps came: the shadow's decode row takes a row of the
    # first forward, its 2-token step leads the next (without ageing: [R1, R2], then the shadows after them; a
    # replica's real sessions in a closed loop held a shadow's prefill, and its decode rows, until they ended)
    assert batches == [2, 1, 1] and done == ["S1", "R1", "S2", "R2"], (batches, done)


async def test_on_an_idle_runtime_a_shadow_row_waits_for_a_real_step_to_ride_with(backend, monkeypatch) -> None:  # noqa: F811
    lead_after_s = 0.4  # (longer than the server's, so that a loaded machine's late wake-up cannot pass it)
    monkeypatch.setattr(engine_executor, "SHADOW_LEAD_AFTER_S", lead_after_s)
    with Runtime(max_batch_size_tokens=1024) as runtime:
        executor = eager_executor(backend, runtime)
        async with (
            executor.open_session(SessionSpec(SPAN, 1, 32), None) as real,
            executor.open_session(SessionSpec(SPAN, 1, 32, shadow=True), None) as shadow,
        ):
            await _prefill(executor, shadow, 4)  # (nothing real came yet: it runs at once)
            await _prefill(executor, real, 4)
            batches: list[int] = []
            runtime.add_batch_observer(lambda kind, steps, seconds: batches.append(steps))

            def decode(cache, position: int):
                inputs = StepInputs(torch.randn(1, 1, H), position, None, None, "", lone_session=False)
                return asyncio.ensure_future(executor.step(cache, inputs))

            shadow_step = decode(shadow, 4)
            await asyncio.sleep(0.05)  # the runtime is idle: the shadow's row waits
            await asyncio.gather(decode(real, 4), shadow_step)
            assert batches == [2], batches  # one forward: the real row and the shadow's
            started = asyncio.get_running_loop().time()
            await decode(shadow, 5)  # no real step comes: it runs alone once it may lead
            waited_s = asyncio.get_running_loop().time() - started
            assert batches == [2, 1] and waited_s >= lead_after_s * 0.9, (batches, waited_s)
            await asyncio.sleep(lead_after_s)  # a replica serving nobody for as long: a shadow's step runs at once
            started = asyncio.get_running_loop().time()
            await decode(shadow, 6)
            waited_s = asyncio.get_running_loop().time() - started
            assert batches == [2, 1, 1] and waited_s < lead_after_s / 2, (batches, waited_s)


async def test_a_full_replica_gives_aged_shadows_one_request_per_forward(backend, monkeypatch) -> None:  # noqa: F811
    """A replica whose forwards are full of real rows (`max_batch_rows` 8, 8 real sessions) with two shadows'
    4-position requests queued past their lead time before the real steps: each forward carries one shadow request
    and 4 real rows, and every step completes (before: the two aged requests took the first forward's 8 rows, the
    real rows none)."""
    monkeypatch.setattr(engine_executor, "SHADOW_LEAD_AFTER_S", 0.1)
    with Runtime(max_batch_size_tokens=1024) as runtime:
        config = EngineConfig(kv_pool_bytes=1 << 20, page_size_tokens=16, max_seq_len_tokens=64, max_batch_rows=8)
        engine = SpanEngine.from_blocks([backend.blocks[i] for i in SPAN], config, fused=False)
        executor = EngineExecutor(backend, engine, runtime, ServerMetrics())
        specs = {f"R{i}": SessionSpec(SPAN, 1, 32) for i in range(8)}
        specs |= {f"S{i}": SessionSpec(SPAN, 1, 32, shadow=True) for i in range(2)}
        async with contextlib.AsyncExitStack() as stack:
            caches = {name: await stack.enter_async_context(executor.open_session(spec, None))
                      for name, spec in specs.items()}  # fmt: skip
            for cache in caches.values():
                await _prefill(executor, cache, 4)
            release = threading.Event()
            held = runtime.submit(release.wait, priority=0.0, size_tokens=1, kind=KIND_GENERIC)
            await asyncio.sleep(0.05)  # the runtime thread runs the held task
            batches: list[int] = []
            runtime.add_batch_observer(lambda kind, steps, seconds: batches.append(steps))

            def step(name: str, tokens: int) -> asyncio.Future:
                inputs = StepInputs(torch.randn(1, tokens, H), 4, None, None, "", lone_session=False)
                return asyncio.ensure_future(executor.step(caches[name], inputs))

            shadows = [step("S0", 4), step("S1", 4)]
            await asyncio.sleep(0.15)  # past their lead time
            reals = [step(f"R{i}", 1) for i in range(8)]
            await asyncio.sleep(0.05)  # all queued
            release.set()
            await held
            outputs = await asyncio.gather(*shadows, *reals)
    assert batches[1:] == [5, 5], batches  # a shadow request and 4 real rows each (the first: the held task)
    assert [tuple(out.shape) for out in outputs] == [(1, 4, H)] * 2 + [(1, 1, H)] * 8


def _step(merge_key: str, *, shadow: bool, queued_s_ago: float = 0.0, tokens: int = 1,
          lead_after_s: float = SHADOW_LEAD_AFTER_S) -> Task:  # fmt: skip
    submitted = time.monotonic() - queued_s_ago
    return Task(fn=lambda: None, priority=PRIORITY_INFERENCE, size_tokens=tokens, future=None, loop=None,
                kind="engine", merge_key=merge_key, submitted_at=submitted,
                lead_after=submitted + lead_after_s if shadow else 0.0)  # fmt: skip


def test_the_queue_ranks_a_held_step_at_its_lead_time() -> None:
    """Real sessions in a closed loop keep a real step queued at every pop: a shadow's prefill chunk (its own merge
    key: no real forward takes it) whose lead time has passed leads the next batch, and the shadows' decode rows then
    ride the real forward (16 real + 12 shadow rows: one batch); where the forward has no spare row, a shadow's decode
    row past its lead time takes one ahead of the real steps queued after then, not of those queued before; a held
    step that may not lead yet lets a less urgent task lead, and stays queued."""
    queue = TaskQueue()

    def pop(rows: int = 64) -> list[Task]:
        batch = queue.pop_batch(max_batch_tokens=64, mergeable_kinds={"engine"}, timeout_s=0.0,
                                merge_limits={"engine": rows})  # fmt: skip
        return batch or []

    chunk = _step("shadow_prefill", shadow=True, queued_s_ago=1.0, tokens=32)
    queue.push(chunk)
    queue.push(_step("decode", shadow=False))
    assert pop() == [chunk]
    assert [task.merge_key for task in pop()] == ["decode"]
    queue.push_many([_step("decode", shadow=False) for _ in range(16)])
    queue.push_many([_step("decode", shadow=True) for _ in range(12)])
    merged = pop()
    assert [bool(task.lead_after) for task in merged] == [False] * 16 + [True] * 12, merged
    before = _step("decode", shadow=False, queued_s_ago=0.5)
    aged = _step("decode", shadow=True, queued_s_ago=0.3)
    after = [_step("decode", shadow=False) for _ in range(2)]
    queue.push_many([*after, aged, before])
    assert pop(rows=2) == [before, aged]
    assert pop(rows=2) == after and not len(queue)
    # a burst of aged shadow requests at a full forward (64 rows): one goes ahead of the real steps, the others take
    # the rows left (before: the first four took all 64, the 64 real steps none)
    reals = [_step("decode", shadow=False) for _ in range(64)]
    aged_requests = [_step("decode", shadow=True, queued_s_ago=1.0, tokens=16) for _ in range(6)]
    queue.push_many([*reals, *aged_requests])
    assert pop() == [aged_requests[0], *reals[:48]]
    assert pop() == [aged_requests[1], *reals[48:], *aged_requests[2:4]]
    assert pop() == aged_requests[4:] and not len(queue)
    works = [Task(fn=lambda: None, priority=PRIORITY_FORWARD, size_tokens=1, future=None, loop=None) for _ in range(2)]
    held = [_step("decode", shadow=True, lead_after_s=10.0) for _ in range(2)]
    queue.push_many([held[0], works[0], held[1], works[1]])
    assert pop() == [works[0]] and pop() == [works[1]] and pop() == [] and len(queue) == 2


async def test_the_mark_reaches_a_handler_process_servers_device(backend) -> None:  # noqa: F811
    with Runtime(max_batch_size_tokens=1024) as runtime:
        real = eager_executor(backend, runtime)
        opened: list[SessionSpec] = []
        open_real = real.open_session

        def spying(spec: SessionSpec, alloc_timeout_s):
            opened.append(spec)
            return open_real(spec, alloc_timeout_s)

        real.open_session = spying  # type: ignore[method-assign]
        async with proxied_executor(real) as link:
            core = RemoteCore(link)
            for shadow in (True, False):
                async with core.open_session(SessionOpen("peer", SessionSpec(SPAN, 1, 16, shadow=shadow))):
                    pass
    assert [spec.shadow for spec in opened] == [True, False]


def test_only_a_bool_marks_a_shadow() -> None:
    assert parse_shadow({SHADOW_KEY: True}) and not parse_shadow({}) and not parse_shadow({SHADOW_KEY: False})
    for bad in (1, "yes", None, [True], {"a": 1}):
        with pytest.raises(ValueError, match=SHADOW_KEY):
            parse_shadow({SHADOW_KEY: bad})
