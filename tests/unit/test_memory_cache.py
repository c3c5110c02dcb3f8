"""MemoryCache: byte budget, FIFO waiting, exact accounting and freeing on every exit path."""

from __future__ import annotations

import asyncio
import random
import threading
import time

import pytest
import torch

from corolla.models.block_base import TensorDescriptor
from corolla.server.memory_cache import MemoryCache, allocation_size_bytes
from corolla.utils.errors import AllocationFailed

CPU = torch.device("cpu")


def desc(nbytes: int) -> TensorDescriptor:
    """A uint8 descriptor of exactly `nbytes` bytes."""
    return TensorDescriptor((nbytes,), torch.uint8, CPU)


async def test_exact_byte_counts() -> None:
    cache = MemoryCache(max_size_bytes=10_000)
    descriptors = [
        TensorDescriptor((2, 3, 5, 7), torch.float32, CPU),  # 840 bytes
        TensorDescriptor((2, 3, 7, 5), torch.bfloat16, CPU),  # 420 bytes
        TensorDescriptor((11,), torch.int64, CPU),  # 88 bytes
    ]
    assert allocation_size_bytes(descriptors) == 840 + 420 + 88
    async with cache.allocate_cache(*descriptors, timeout_s=0) as handles:
        assert len(handles) == 3 and len(set(handles)) == 3
        assert cache.current_size_bytes == 1348
        assert cache.bytes_left == 10_000 - 1348
        async with cache.allocate_cache(desc(1000), timeout_s=0):
            assert cache.current_size_bytes == 2348
        assert cache.current_size_bytes == 1348
    assert cache.current_size_bytes == 0 and cache.bytes_left == 10_000 and cache.num_handles == 0


async def test_zero_timeout_fails_at_once_with_sizes_in_message() -> None:
    cache = MemoryCache(max_size_bytes=1000)
    async with cache.allocate_cache(desc(600), timeout_s=0):
        started = time.monotonic()
        with pytest.raises(AllocationFailed) as info:
            async with cache.allocate_cache(desc(500), timeout_s=0):
                pytest.fail("allocation should not fit")
        assert time.monotonic() - started < 0.5
        message = str(info.value)
        assert "500 bytes" in message and "400 bytes" in message and "1000 bytes" in message
        assert cache.current_size_bytes == 600 and cache.num_waiting == 0
        # what still fits is granted
        async with cache.allocate_cache(desc(400), timeout_s=0):
            assert cache.bytes_left == 0
    assert cache.current_size_bytes == 0


async def test_bigger_than_budget_fails_at_once_even_with_long_timeout() -> None:
    cache = MemoryCache(max_size_bytes=1000)
    started = time.monotonic()
    with pytest.raises(AllocationFailed, match="1001 bytes"):
        async with cache.allocate_cache(desc(1001), timeout_s=60):
            pass
    assert time.monotonic() - started < 0.5
    assert cache.current_size_bytes == 0 and cache.num_waiting == 0


async def test_waits_then_succeeds_when_memory_is_freed() -> None:
    cache = MemoryCache(max_size_bytes=1000)
    release_first = asyncio.Event()

    async def holder() -> None:
        async with cache.allocate_cache(desc(800), timeout_s=0):
            await release_first.wait()

    async def waiter() -> int:
        async with cache.allocate_cache(desc(500), timeout_s=10):
            return cache.current_size_bytes

    hold_task = asyncio.create_task(holder())
    await asyncio.sleep(0.01)
    wait_task = asyncio.create_task(waiter())
    await asyncio.sleep(0.05)
    assert not wait_task.done() and cache.num_waiting == 1
    release_first.set()
    assert await asyncio.wait_for(wait_task, 5) == 500
    await hold_task
    assert cache.current_size_bytes == 0 and cache.num_waiting == 0


async def test_timeout_while_waiting_fails_and_unblocks_the_queue() -> None:
    cache = MemoryCache(max_size_bytes=1000)
    async with cache.allocate_cache(desc(900), timeout_s=0):

        async def alloc(size: int, timeout_s: float) -> str:
            async with cache.allocate_cache(desc(size), timeout_s=timeout_s):
                return "ok"

        big = asyncio.create_task(alloc(500, 0.1))
        await asyncio.sleep(0.01)
        small = asyncio.create_task(alloc(100, 10))  # fits now, but waits behind `big` (FIFO)
        await asyncio.sleep(0.02)
        assert not small.done()
        with pytest.raises(AllocationFailed, match="within 0.1 s"):
            await asyncio.wait_for(big, 5)
        # the timed-out head no longer blocks the queue
        assert await asyncio.wait_for(small, 5) == "ok"
    assert cache.current_size_bytes == 0 and cache.num_waiting == 0


async def test_max_alloc_timeout_caps_the_requested_timeout() -> None:
    cache = MemoryCache(max_size_bytes=1000, max_alloc_timeout_s=0.1)
    async with cache.allocate_cache(desc(1000), timeout_s=0):
        started = time.monotonic()
        with pytest.raises(AllocationFailed):
            async with cache.allocate_cache(desc(10), timeout_s=1000):
                pass
        assert time.monotonic() - started < 3
    assert cache.num_waiting == 0


async def test_waiting_allocations_are_served_in_fifo_order() -> None:
    cache = MemoryCache(max_size_bytes=1000)
    order: list[str] = []
    releases = {name: asyncio.Event() for name in ["first", "big", "small1", "small2"]}

    async def alloc(name: str, size: int) -> None:
        async with cache.allocate_cache(desc(size), timeout_s=10):
            order.append(name)
            await releases[name].wait()

    tasks = [asyncio.create_task(alloc("first", 900))]
    await asyncio.sleep(0.01)
    tasks.append(asyncio.create_task(alloc("big", 1000)))
    await asyncio.sleep(0.01)
    # each of these would fit next to `first`, but must not overtake the big request
    tasks.append(asyncio.create_task(alloc("small1", 50)))
    tasks.append(asyncio.create_task(alloc("small2", 50)))
    await asyncio.sleep(0.05)
    assert order == ["first"] and cache.num_waiting == 3

    releases["first"].set()
    await asyncio.sleep(0.05)
    assert order == ["first", "big"] and cache.current_size_bytes == 1000

    releases["big"].set()
    await asyncio.sleep(0.05)
    assert order == ["first", "big", "small1", "small2"] and cache.current_size_bytes == 100

    releases["small1"].set()
    releases["small2"].set()
    await asyncio.wait_for(asyncio.gather(*tasks), 5)
    assert cache.current_size_bytes == 0


async def test_cancellation_frees_waiting_and_held_allocations() -> None:
    cache = MemoryCache(max_size_bytes=1000)
    entered = asyncio.Event()

    async def hold_forever(size: int) -> None:
        async with cache.allocate_cache(desc(size), timeout_s=10):
            entered.set()
            await asyncio.sleep(3600)

    holder = asyncio.create_task(hold_forever(700))
    await asyncio.wait_for(entered.wait(), 5)
    waiting = asyncio.create_task(hold_forever(700))
    await asyncio.sleep(0.02)
    assert cache.num_waiting == 1

    waiting.cancel()  # cancelled while queued
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert cache.num_waiting == 0 and cache.current_size_bytes == 700

    holder.cancel()  # cancelled while holding
    with pytest.raises(asyncio.CancelledError):
        await holder
    assert cache.current_size_bytes == 0 and cache.num_handles == 0


async def test_exception_inside_allocation_frees_it() -> None:
    cache = MemoryCache(max_size_bytes=1000)
    with pytest.raises(ZeroDivisionError):
        async with cache.allocate_cache(desc(300), desc(200), timeout_s=0):
            assert cache.current_size_bytes == 500
            _ = 1 / 0
    assert cache.current_size_bytes == 0 and cache.num_handles == 0


async def test_no_leak_after_many_concurrent_allocations() -> None:
    budget = 10_000
    cache = MemoryCache(max_size_bytes=budget)
    rng = random.Random(0)
    peak = 0
    outcomes = {"ok": 0, "failed": 0, "error": 0, "cancelled": 0}

    async def session(i: int) -> None:
        nonlocal peak
        size = rng.randint(1, 4000)
        try:
            async with cache.allocate_cache(desc(size), desc(size // 2), timeout_s=rng.choice([0, 0.05, 1.0])):
                peak = max(peak, cache.current_size_bytes)
                assert cache.current_size_bytes <= budget
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
    assert cache.current_size_bytes == 0 and cache.bytes_left == budget
    assert cache.num_waiting == 0 and cache.num_handles == 0


async def test_use_cache_materializes_zeros_lazily_and_rejects_freed_handles() -> None:
    cache = MemoryCache(max_size_bytes=None)
    descriptors = [TensorDescriptor((2, 3), torch.float32, CPU), TensorDescriptor((4,), torch.bfloat16, CPU)]
    result: dict[str, object] = {}

    def in_runtime_thread(fn):
        thread = threading.Thread(target=lambda: result.__setitem__("value", _capture(fn)))
        thread.start()
        thread.join(5)
        return result["value"]

    async with cache.allocate_cache(*descriptors, timeout_s=0) as handles:
        first = in_runtime_thread(lambda: cache.use_cache(*handles))
        assert [tuple(t.shape) for t in first] == [(2, 3), (4,)]
        assert [t.dtype for t in first] == [torch.float32, torch.bfloat16]
        assert all(bool((t == 0).all()) for t in first)
        first[0].add_(1.5)
        again = in_runtime_thread(lambda: cache.use_cache(handles[0]))
        assert again[0] is first[0] and bool((again[0] == 1.5).all())
    error = in_runtime_thread(lambda: cache.use_cache(handles[0]))
    assert isinstance(error, KeyError)


def _capture(fn):
    try:
        return fn()
    except Exception as e:
        return e


async def test_rejects_bad_arguments() -> None:
    cache = MemoryCache(max_size_bytes=100)
    with pytest.raises(ValueError, match="timeout"):
        async with cache.allocate_cache(desc(1), timeout_s=-1):
            pass
    with pytest.raises(ValueError):
        async with cache.allocate_cache(timeout_s=0):
            pass
    assert cache.current_size_bytes == 0
