"""PageQueue over a KVPool (the one KV store's allocation): whole-page accounting, FIFO waiting, timeouts and
their cap, and pages returned on every exit path (success, timeout, cancellation while waiting or holding, errors)."""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import AsyncIterator

import pytest
import torch

from corolla.engine.kv.kv_pool import KVLayout, KVPool
from corolla.engine.kv.page_queue import PageQueue
from corolla.utils.errors import AllocationFailed

PAGE = 16  # tokens per page


def make_queue(usable_pages: int, max_wait_s: float | None = None) -> PageQueue:
    pool = KVPool(num_layers=2, layout=KVLayout.heads(1, 4), num_pages=usable_pages + 1, page_size_tokens=PAGE,
                  max_pages_per_seq=usable_pages + 1, dtype=torch.float32, device="cpu")  # fmt: skip
    return PageQueue(pool, max_wait_s)


def used(queue: PageQueue) -> int:
    return queue.pool.num_pages - 1 - queue.pool.pages_free


@contextlib.asynccontextmanager
async def held(queue: PageQueue, pages: int, timeout_s: float | None, sequences: int = 1) -> AsyncIterator[None]:
    """`pages` pages over `sequences` sequences of whole pages, returned on exit."""
    slots = await queue.allocate(sequences, pages // sequences * PAGE, timeout_s)
    try:
        yield
    finally:
        queue.release(slots)


async def test_exact_page_counts() -> None:
    queue = make_queue(100)
    slots = await queue.allocate(3, 2 * PAGE + 1, 0)  # 3 pages per sequence: whole pages, rounded up
    assert [len(s.pages) for s in slots] == [0, 0, 0] and [s.promised_pages for s in slots] == [3, 3, 3]
    assert used(queue) == 9 and all(s.capacity_tokens == 3 * PAGE for s in slots)  # promised counts as used
    queue.pool.grow(slots, 2 * PAGE + 1)  # the positions arrive: the promise becomes pages
    assert [len(s.pages) for s in slots] == [3, 3, 3] and len({p for s in slots for p in s.pages}) == 9
    assert used(queue) == 9 and queue.pool.layer_pages_taken == 2 * 9
    async with held(queue, 10, 0):
        assert used(queue) == 19
    assert used(queue) == 9
    queue.release(slots)
    queue.release(slots)  # idempotent
    assert used(queue) == 0 and queue.pool.pages_free == 100


async def test_sequences_over_other_layers_share_page_ids() -> None:
    queue = make_queue(4)  # 2 layers
    pool = queue.pool
    first = await queue.allocate(1, 4 * PAGE, 0, layers=(0, 1))  # every page of layer 0
    assert pool.layer_pages_free == 4 and pool.pages_free == 2
    with pytest.raises(AllocationFailed, match="0 of 4 free in layers 0:2"):
        await queue.allocate(1, PAGE, 0)  # all layers: no id is free in both
    second = await queue.allocate(1, 4 * PAGE, 0, layers=(1, 2))  # the same ids in layer 1
    pool.grow(first, 4 * PAGE)
    pool.grow(second, 4 * PAGE)
    assert sorted(first[0].pages) == sorted(second[0].pages) == [1, 2, 3, 4] and pool.layer_pages_free == 0
    queue.release(first)
    assert pool.layer_pages_free == 4
    with pytest.raises(AllocationFailed):
        await queue.allocate(1, PAGE, 0, layers=(1, 2))
    queue.release(second)
    assert pool.layer_pages_free == 8 and pool.pages_free == 4
    with pytest.raises(ValueError, match="layers"):
        await queue.allocate(1, PAGE, 0, layers=(1, 3))


async def test_zero_timeout_fails_at_once_with_sizes_in_message() -> None:
    queue = make_queue(10)
    async with held(queue, 6, 0):
        started = time.monotonic()
        with pytest.raises(AllocationFailed) as info:
            async with held(queue, 5, 0):
                pytest.fail("allocation should not fit")
        assert time.monotonic() - started < 0.5
        message = str(info.value)
        assert "need 5 pages" in message and "4 of 10 free" in message and "alloc_timeout is 0" in message
        assert used(queue) == 6 and queue.num_waiting == 0
        async with held(queue, 4, 0):  # what still fits is granted
            assert queue.pool.pages_free == 0
    assert used(queue) == 0


async def test_bigger_than_the_pool_fails_at_once_even_with_long_timeout() -> None:
    queue = make_queue(10)
    started = time.monotonic()
    with pytest.raises(AllocationFailed, match="11 KV pages.*whole pool of 10 pages"):
        async with held(queue, 11, 60, sequences=11):
            pass
    assert time.monotonic() - started < 0.5
    assert used(queue) == 0 and queue.num_waiting == 0


async def test_waits_then_succeeds_when_pages_are_freed() -> None:
    queue = make_queue(10)
    release_first = asyncio.Event()

    async def holder() -> None:
        async with held(queue, 8, 0):
            await release_first.wait()

    async def waiter() -> int:
        async with held(queue, 5, 10):
            return used(queue)

    hold_task = asyncio.create_task(holder())
    await asyncio.sleep(0.01)
    wait_task = asyncio.create_task(waiter())
    await asyncio.sleep(0.05)
    assert not wait_task.done() and queue.num_waiting == 1 and queue.layer_pages_waiting == 5 * 2
    release_first.set()
    assert await asyncio.wait_for(wait_task, 5) == 5
    await hold_task
    assert used(queue) == 0 and queue.num_waiting == 0


async def test_timeout_while_waiting_fails_and_unblocks_the_queue() -> None:
    queue = make_queue(10)
    async with held(queue, 9, 0):

        async def alloc(pages: int, timeout_s: float) -> str:
            async with held(queue, pages, timeout_s):
                return "ok"

        big = asyncio.create_task(alloc(5, 0.1))
        await asyncio.sleep(0.01)
        small = asyncio.create_task(alloc(1, 10))  # fits now, but waits behind `big` (FIFO)
        await asyncio.sleep(0.02)
        assert not small.done()
        with pytest.raises(AllocationFailed, match="within 0.1 s"):
            await asyncio.wait_for(big, 5)
        # the timed-out head no longer blocks the queue
        assert await asyncio.wait_for(small, 5) == "ok"
    assert used(queue) == 0 and queue.num_waiting == 0


async def test_max_wait_caps_the_requested_timeout() -> None:
    queue = make_queue(10, max_wait_s=0.1)
    async with held(queue, 10, 0):
        started = time.monotonic()
        with pytest.raises(AllocationFailed):
            async with held(queue, 1, 1000):
                pass
        assert time.monotonic() - started < 3
    assert queue.num_waiting == 0


async def test_waiting_allocations_are_served_in_fifo_order() -> None:
    queue = make_queue(10)
    order: list[str] = []
    releases = {name: asyncio.Event() for name in ["first", "big", "small1", "small2"]}

    async def alloc(name: str, pages: int) -> None:
        async with held(queue, pages, 10):
            order.append(name)
            await releases[name].wait()

    tasks = [asyncio.create_task(alloc("first", 9))]
    await asyncio.sleep(0.01)
    tasks.append(asyncio.create_task(alloc("big", 10)))
    await asyncio.sleep(0.01)
    # each of these would fit next to `first`, but must not overtake the big request
    tasks.append(asyncio.create_task(alloc("small1", 1)))
    tasks.append(asyncio.create_task(alloc("small2", 1)))
    await asyncio.sleep(0.05)
    assert order == ["first"] and queue.num_waiting == 3

    releases["first"].set()
    await asyncio.sleep(0.05)
    assert order == ["first", "big"] and used(queue) == 10

    releases["big"].set()
    await asyncio.sleep(0.05)
    assert order == ["first", "big", "small1", "small2"] and used(queue) == 2

    releases["small1"].set()
    releases["small2"].set()
    await asyncio.wait_for(asyncio.gather(*tasks), 5)
    assert used(queue) == 0


async def test_cancellation_frees_waiting_and_held_allocations() -> None:
    queue = make_queue(10)
    entered = asyncio.Event()

    async def hold_forever(pages: int) -> None:
        async with held(queue, pages, 10):
            entered.set()
            await asyncio.sleep(3600)

    holder = asyncio.create_task(hold_forever(7))
    await asyncio.wait_for(entered.wait(), 5)
    waiting = asyncio.create_task(hold_forever(7))
    await asyncio.sleep(0.02)
    assert queue.num_waiting == 1

    waiting.cancel()  # cancelled while queued
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert queue.num_waiting == 0 and used(queue) == 7

    holder.cancel()  # cancelled while holding
    with pytest.raises(asyncio.CancelledError):
        await holder
    assert used(queue) == 0


async def test_exception_inside_allocation_frees_it() -> None:
    queue = make_queue(10)
    with pytest.raises(ZeroDivisionError):
        async with held(queue, 4, 0, sequences=2):
            assert used(queue) == 4
            _ = 1 / 0
    assert used(queue) == 0


async def test_no_leak_after_many_concurrent_allocations() -> None:
    budget = 100
    queue = make_queue(budget)
    rng = random.Random(0)
    peak = 0
    outcomes = {"ok": 0, "failed": 0, "error": 0, "cancelled": 0}

    async def session(i: int) -> None:
        nonlocal peak
        sequences = rng.randint(1, 2)
        pages = sequences * rng.randint(1, 20)
        try:
            async with held(queue, pages, rng.choice([0, 0.05, 1.0]), sequences=sequences):
                peak = max(peak, used(queue))
                assert used(queue) <= budget
                await asyncio.sleep(rng.random() * 0.01)
                if i % 7 == 0:
                    raise RuntimeError("client went away")
            outcomes["ok"] += 1
        except AllocationFailed:
            outcomes["failed"] += 1
        except RuntimeError:
            outcomes["error"] += 1

    tasks = [asyncio.create_task(session(i)) for i in range(300)]
    await asyncio.sleep(0.02)
    for task in tasks[::11]:
        if task.cancel():
            outcomes["cancelled"] += 1
    results = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 30)
    assert all(r is None or isinstance(r, asyncio.CancelledError) for r in results)
    assert outcomes["ok"] > 0 and outcomes["failed"] > 0 and outcomes["error"] > 0
    assert 0 < peak <= budget
    assert used(queue) == 0 and queue.pool.pages_free == budget
    assert queue.num_waiting == 0


async def test_rejects_bad_arguments() -> None:
    queue = make_queue(10)
    with pytest.raises(ValueError, match="timeout"):
        await queue.allocate(1, PAGE, -1)
    with pytest.raises(ValueError, match="timeout"):
        await queue.allocate(1, PAGE, float("nan"))
    with pytest.raises(ValueError, match="num_sequences"):
        await queue.allocate(0, PAGE, 0)
    with pytest.raises(ValueError, match="max_wait_s"):
        make_queue(10, max_wait_s=-1)
    assert used(queue) == 0


async def test_a_request_that_fits_beside_the_line_is_granted_at_once() -> None:
    queue = make_queue(10)
    async with held(queue, 6, 0):
        big = asyncio.create_task(queue.allocate(1, 8 * PAGE, 5))  # waits: 4 free
        await asyncio.sleep(0.01)
        assert queue.num_waiting == 1
        with pytest.raises(AllocationFailed, match="waiting before it"):
            await queue.allocate(1, PAGE, 0)  # would take what the big one waits for
    slots = await asyncio.wait_for(big, 5)
    small = await queue.allocate(1, 2 * PAGE, 0)  # 2 left beside nothing waiting
    queue.release(slots + small)
    async with held(queue, 7, 0):
        big = asyncio.create_task(queue.allocate(1, 4 * PAGE, 5))  # waits for 4 of 3 free
        await asyncio.sleep(0.01)
        with pytest.raises(AllocationFailed):
            await queue.allocate(1, PAGE, 0)  # 3 free - 4 waited for: no room beside it
    queue.release(await asyncio.wait_for(big, 5))
    assert used(queue) == 0


async def test_the_head_of_the_line_asks_for_room_until_it_fits() -> None:
    queue = make_queue(4)
    hoard = await queue.allocate(1, 4 * PAGE, 0)
    asked: list[int] = []

    def on_short(layer_pages: int) -> None:
        asked.append(layer_pages)
        if len(asked) == 3:  # a hold becomes yieldable after a while: it is ended
            queue.release(hoard)

    queue.on_short = on_short
    started = time.monotonic()
    slots = await queue.allocate(1, 2 * PAGE, 2.0)
    assert asked[0] == 2 * 2 and len(asked) == 3  # 2 pages in each of the 2 layers, asked at every nudge
    assert 0.15 < time.monotonic() - started < 1.0
    queue.release(slots)
