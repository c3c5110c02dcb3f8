"""Waiting for free pages of a `KVPool` in arrival order: `PageQueue.allocate` (in one asyncio loop) takes a
session's promise now when it fits beside what the allocations in line wait for, or waits up to a timeout behind them
(small requests can't starve a big one); `PageQueue.release` returns pages and hands them to the waiters whose turn
it is. While the head of the line does not fit, `on_short` (admission) is asked to make the least valuable holds
yield, at every release and every `NUDGE_S` of a wait."""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from corolla.engine.kv.kv_pool import KVPool, SequenceSlot
from corolla.utils.errors import AllocationFailed
from corolla.utils.logging import get_logger

logger = get_logger(__name__)

NUDGE_S = 0.1  # a waiting allocation asks `on_short` again this often (holds become yieldable as time passes)


@dataclass(eq=False)
class PageWaiter:
    """One allocation waiting in line: `num_sequences` x `max_length_tokens` in layers [first, end), `pages` pages
    in each of them."""

    num_sequences: int
    max_length_tokens: int
    layers: tuple[int, int]
    pages: int
    future: asyncio.Future[list[SequenceSlot]]


class PageQueue:
    """FIFO allocation of a pool's pages for one event loop (see the module docstring). `max_wait_s` caps every
    wait (None: no cap)."""

    def __init__(self, pool: KVPool, max_wait_s: float | None = None):
        if max_wait_s is not None and not max_wait_s >= 0:
            raise ValueError(f"max_wait_s must be >= 0, got {max_wait_s}")
        self.pool = pool
        self.max_wait_s = max_wait_s
        self._waiters: deque[PageWaiter] = deque()
        # called with the pages (summed over layers) the head of the line needs while it does not fit
        self.on_short: Callable[[int], None] | None = None

    @property
    def layer_pages_waiting(self) -> int:
        """Pages asked for by the allocations in line, summed over their layers."""
        return sum(w.pages * (w.layers[1] - w.layers[0]) for w in self._waiters if not w.future.done())

    @property
    def num_waiting(self) -> int:
        return sum(1 for w in self._waiters if not w.future.done())

    async def allocate(
        self, num_sequences: int, max_length_tokens: int, timeout_s: float | None, layers: tuple[int, int] | None = None
    ) -> list[SequenceSlot]:
        """The pages of `num_sequences` sequences of `max_length_tokens` in `layers` [first, end) (default: all),
        waiting up to `timeout_s` (None: up to
        `max_wait_s`) behind earlier allocations. AllocationFailed when they can't come in time (at once if they
        exceed the whole pool); ValueError past the pool's longest sequence or for a negative timeout."""
        if timeout_s is not None and not timeout_s >= 0:  # also refuses NaN
            raise ValueError(f"Allocation timeout must be >= 0 seconds, got {timeout_s}")
        if self.max_wait_s is not None:
            timeout_s = self.max_wait_s if timeout_s is None else min(timeout_s, self.max_wait_s)
        pool = self.pool
        layers = pool.check_layers(layers)
        pages = pool.pages_for(max_length_tokens) * num_sequences
        if pages > pool.num_pages - 1:
            raise AllocationFailed(
                f"Could not allocate {pages} KV pages ({num_sequences} x {max_length_tokens} tokens): more than the "
                f"server's whole pool of {pool.num_pages - 1} pages; ask for a shorter max_length or a smaller batch"
            )
        layer_pages = pages * (layers[1] - layers[0])
        if not self._waiters_left():
            try:
                return pool.allocate(num_sequences, max_length_tokens, layers)
            except AllocationFailed as e:
                if timeout_s == 0:
                    raise AllocationFailed(f"{e}; alloc_timeout is 0") from None
        elif pool.layer_pages_free - self.layer_pages_waiting >= layer_pages:
            # it fits beside what the allocations in line wait for: taking it now delays none of them
            with contextlib.suppress(AllocationFailed):
                return pool.allocate(num_sequences, max_length_tokens, layers)
        if timeout_s == 0:
            raise AllocationFailed(
                f"Could not allocate {pages} KV pages ({num_sequences} x {max_length_tokens} tokens): "
                f"{self.num_waiting} allocations waiting before it and alloc_timeout is 0"
            )
        future: asyncio.Future[list[SequenceSlot]] = asyncio.get_running_loop().create_future()
        waiter = PageWaiter(num_sequences, max_length_tokens, layers, pages, future)
        self._waiters.append(waiter)
        logger.info(f"page_queue.wait(pages={pages}, layers={layers}, queue={len(self._waiters)}, "
                    f"timeout_s={timeout_s})")  # fmt: skip
        self.wake()  # the head of the line may be this one, or may get others to yield now
        try:
            return await self._wait(waiter, timeout_s)
        except asyncio.TimeoutError:
            if waiter.future.done() and not waiter.future.cancelled():  # granted right at the deadline: keep it
                return waiter.future.result()
            self._drop(waiter)
            raise AllocationFailed(
                f"Could not allocate {pages} KV pages ({num_sequences} x {max_length_tokens} tokens) within "
                f"{timeout_s} s: {self.num_waiting} allocations still waiting"
            ) from None
        except BaseException:  # cancelled while waiting: give back whatever was granted
            if waiter.future.done() and not waiter.future.cancelled():
                self.release(waiter.future.result())
            else:
                self._drop(waiter)
            raise

    async def _wait(self, waiter: PageWaiter, timeout_s: float | None) -> list[SequenceSlot]:
        """The waiter's pages within `timeout_s` (asyncio.TimeoutError after it), nudging the line every `NUDGE_S`
        where someone can make room (`on_short`)."""
        if self.on_short is None:
            return await asyncio.wait_for(asyncio.shield(waiter.future), timeout_s)
        loop = asyncio.get_running_loop()
        deadline = None if timeout_s is None else loop.time() + timeout_s
        while True:
            slice_s = NUDGE_S if deadline is None else min(NUDGE_S, deadline - loop.time())
            if slice_s <= 0:
                raise asyncio.TimeoutError
            try:
                return await asyncio.wait_for(asyncio.shield(waiter.future), slice_s)
            except asyncio.TimeoutError:
                self.wake()

    def release(self, slots: Sequence[SequenceSlot]) -> None:
        """Returns the slots' pages (idempotent) and grants the waiters at the head of the line that now fit."""
        self.pool.free(slots)
        self.wake()

    def wake(self) -> None:
        """Grants waiting allocations in arrival order while the head of the line fits (asking `on_short` once to
        make room for a head that does not)."""
        asked = False
        while self._waiters:
            head = self._waiters[0]
            if head.future.done():
                self._waiters.popleft()
                continue
            try:
                slots = self.pool.allocate(head.num_sequences, head.max_length_tokens, head.layers)
            except AllocationFailed:
                if self.on_short is None or asked:
                    return
                asked = True
                self.on_short(head.pages * (head.layers[1] - head.layers[0]))
                continue
            self._waiters.popleft()
            head.future.set_result(slots)
            asked = False

    def _waiters_left(self) -> bool:
        while self._waiters and self._waiters[0].future.done():
            self._waiters.popleft()
        return bool(self._waiters)

    def _drop(self, waiter: PageWaiter) -> None:
        with contextlib.suppress(ValueError):
            self._waiters.remove(waiter)
        waiter.future.cancel()
        self.wake()  # the dropped waiter may have been holding up the line
