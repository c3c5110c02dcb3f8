"""KV-cache memory with a byte budget: the event loop reserves bytes (`allocate_cache`, FIFO waiting, freed on every
exit path); the runtime thread materializes the tensors lazily on first `use_cache`."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import math
import threading
from collections import deque
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from corolla.utils.errors import AllocationFailed
from corolla.utils.logging import get_logger

logger = get_logger(__name__)

Handle = int
UNLIMITED_BYTES = 2**63 - 1


class TensorDescriptorLike(Protocol):
    """What `models.block_base.TensorDescriptor` offers: the shape, dtype and device of one cache tensor (read-only
    properties, so that frozen dataclasses match)."""

    @property
    def shape(self) -> Sequence[int]: ...

    @property
    def dtype(self) -> torch.dtype: ...

    @property
    def device(self) -> Any: ...


def descriptor_nbytes(descriptor: TensorDescriptorLike) -> int:
    """Exact bytes of the tensor a descriptor describes."""
    return math.prod(int(s) for s in descriptor.shape) * descriptor.dtype.itemsize


def allocation_size_bytes(descriptors: Sequence[TensorDescriptorLike]) -> int:
    """Bytes charged for one allocation: the sum over all its tensors, on all devices."""
    return sum(descriptor_nbytes(d) for d in descriptors)


def _fmt_bytes(n: int) -> str:
    return f"{n} bytes ({n / 2**20:.2f} MiB)"


@dataclass(eq=False)
class _Waiter:
    size_bytes: int
    future: asyncio.Future

    @property
    def granted(self) -> bool:
        return self.future.done() and not self.future.cancelled()


class MemoryCache:
    """A byte budget for attention caches shared by all sessions of a server.

    Bookkeeping (`allocate_cache`, `bytes_left`) happens in one asyncio loop; `use_cache` runs in the runtime thread.
    Waiting allocations are served strictly in arrival order, so small requests cannot starve a big one.
    """

    def __init__(self, max_size_bytes: int | None, max_alloc_timeout_s: float | None = None):
        if max_size_bytes is not None and max_size_bytes < 0:
            raise ValueError(f"max_size_bytes must be >= 0, got {max_size_bytes}")
        if max_alloc_timeout_s is not None and max_alloc_timeout_s < 0:
            raise ValueError(f"max_alloc_timeout_s must be >= 0, got {max_alloc_timeout_s}")
        self._max_size_bytes = UNLIMITED_BYTES if max_size_bytes is None else int(max_size_bytes)
        self.max_alloc_timeout_s = max_alloc_timeout_s
        self._current_size_bytes = 0
        self._waiters: deque[_Waiter] = deque()
        self._handle_counter = itertools.count()
        self._lock = threading.Lock()  # guards the two dicts below (event loop vs runtime thread)
        self._descriptors: dict[Handle, TensorDescriptorLike] = {}
        self._tensors: dict[Handle, torch.Tensor] = {}

    @property
    def max_size_bytes(self) -> int:
        return self._max_size_bytes

    @property
    def current_size_bytes(self) -> int:
        return self._current_size_bytes

    @property
    def bytes_left(self) -> int:
        return self._max_size_bytes - self._current_size_bytes

    @property
    def num_waiting(self) -> int:
        return len(self._waiters)

    @property
    def bytes_waiting(self) -> int:
        """Bytes asked for by the allocations waiting in the queue."""
        return sum(w.size_bytes for w in self._waiters if not w.future.done())

    @property
    def num_handles(self) -> int:
        with self._lock:
            return len(self._descriptors)

    @contextlib.asynccontextmanager
    async def allocate_cache(
        self, *descriptors: TensorDescriptorLike, timeout_s: float | None = 0.0
    ) -> AsyncIterator[tuple[Handle, ...]]:
        """Reserves bytes for `descriptors` (waiting up to `timeout_s`, capped by `max_alloc_timeout_s`; None waits
        up to the cap) and yields one handle per descriptor; frees them on exit, whatever the exit path.
        Raises AllocationFailed when the budget cannot hold them in time."""
        if not descriptors:
            raise ValueError("allocate_cache needs at least one tensor descriptor")
        if timeout_s is not None and not timeout_s >= 0:  # also rejects NaN
            raise ValueError(f"Allocation timeout must be >= 0 seconds, got {timeout_s}")
        if self.max_alloc_timeout_s is not None:
            timeout_s = self.max_alloc_timeout_s if timeout_s is None else min(timeout_s, self.max_alloc_timeout_s)
        size = allocation_size_bytes(descriptors)
        await self._reserve(size, timeout_s)
        with self._lock:
            handles = tuple(next(self._handle_counter) for _ in descriptors)
            self._descriptors.update(zip(handles, descriptors, strict=True))
        logger.debug(f"memory_cache.allocated(bytes={size}, handles={len(handles)}, left={self.bytes_left})")
        try:
            yield handles
        finally:
            self._release(handles, size)

    def use_cache(self, *handles: Handle) -> list[torch.Tensor]:
        """Returns the tensors of `handles` (zeros, created on the descriptor's device on first use).
        Call from the runtime thread. Raises KeyError for a freed or unknown handle."""
        with self._lock:
            result = []
            for handle in handles:
                tensor = self._tensors.get(handle)
                if tensor is None:
                    descriptor = self._descriptors.get(handle)
                    if descriptor is None:
                        raise KeyError(f"Cache handle {handle} is not allocated (freed or never allocated)")
                    tensor = torch.zeros(tuple(descriptor.shape), dtype=descriptor.dtype, device=descriptor.device)
                    self._tensors[handle] = tensor
                result.append(tensor)
            return result

    # ---- internals (event loop)

    async def _reserve(self, size: int, timeout_s: float | None) -> None:
        if size > self._max_size_bytes:
            raise AllocationFailed(
                f"Could not allocate {_fmt_bytes(size)} of attention cache: more than the server's whole "
                f"budget of {_fmt_bytes(self._max_size_bytes)}; ask for a shorter max_length or a smaller batch"
            )
        if not self._waiters and self._current_size_bytes + size <= self._max_size_bytes:
            self._current_size_bytes += size
            return
        if timeout_s == 0:
            raise AllocationFailed(
                f"Could not allocate {_fmt_bytes(size)} of attention cache: only {_fmt_bytes(self.bytes_left)} left "
                f"of {_fmt_bytes(self._max_size_bytes)} ({len(self._waiters)} allocations waiting) and "
                f"alloc_timeout is 0"
            )
        waiter = _Waiter(size, asyncio.get_running_loop().create_future())
        self._waiters.append(waiter)
        logger.info(
            f"memory_cache.wait_for_alloc(bytes={size}, left={self.bytes_left}, max={self._max_size_bytes}, "
            f"queue={len(self._waiters)}, timeout_s={timeout_s})"
        )
        try:
            await asyncio.wait_for(asyncio.shield(waiter.future), timeout_s)
        except asyncio.TimeoutError:
            if waiter.granted:  # granted right at the deadline: keep it
                return
            self._drop_waiter(waiter)
            raise AllocationFailed(
                f"Could not allocate {_fmt_bytes(size)} of attention cache within {timeout_s} s: "
                f"{_fmt_bytes(self.bytes_left)} left of {_fmt_bytes(self._max_size_bytes)} "
                f"({len(self._waiters)} allocations still waiting)"
            ) from None
        except BaseException:  # cancelled while waiting: give back whatever we hold
            if waiter.granted:
                self._current_size_bytes -= size
                self._wake_waiters()
            else:
                self._drop_waiter(waiter)
            raise

    def _drop_waiter(self, waiter: _Waiter) -> None:
        with contextlib.suppress(ValueError):
            self._waiters.remove(waiter)
        waiter.future.cancel()
        self._wake_waiters()  # the dropped waiter may have been blocking the queue's head

    def _wake_waiters(self) -> None:
        """Grants waiting allocations in arrival order while the head of the queue fits."""
        while self._waiters and self._current_size_bytes + self._waiters[0].size_bytes <= self._max_size_bytes:
            waiter = self._waiters.popleft()
            if waiter.future.done():
                continue
            self._current_size_bytes += waiter.size_bytes
            waiter.future.set_result(None)

    def _release(self, handles: tuple[Handle, ...], size: int) -> None:
        with self._lock:
            for handle in handles:
                self._descriptors.pop(handle, None)
                self._tensors.pop(handle, None)
        self._current_size_bytes -= size
        assert self._current_size_bytes >= 0, f"memory_cache accounting went negative ({self._current_size_bytes})"
        logger.debug(f"memory_cache.freed(bytes={size}, left={self.bytes_left})")
        self._wake_waiters()
