"""Block inputs of a training forward kept for the backward of the same micro-batch: Petals' `rpc_backward` re-sends its
forward's inputs, so where a backward's inputs, prompts, span, adapter and client equal a recent forward's, that
forward's block inputs are taken from here (at 32 blocks: 32 block calls instead of 63). Exact (equal received
tensors), per client (`owner`: no timing side channel between clients), bounded (`max_bytes`, `keep_s`, the
device's `floor_bytes`; the client holding most loses its oldest first); a miss only costs the recomputation."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

# a backward follows its forward within the client's loss and the later spans' backwards: seconds
KEEP_S = 60.0


@dataclass(eq=False, slots=True)
class _Entry:
    owner: str
    span: tuple[int, ...]
    adapter: str
    hidden: torch.Tensor  # [B, T, H] the forward's inputs as received (the key)
    prompts: torch.Tensor | None  # [n_blocks, B|1, P, H] as received, or None
    inputs: list[torch.Tensor]  # [B, T, H] each: the inputs of the span's blocks after the first
    nbytes: int
    kept_at: float


def _nbytes(tensors: list[torch.Tensor | None]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def _same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return a.dtype == b.dtype and a.shape == b.shape and a.device == b.device and torch.equal(a, b)


def device_free_bytes(device: torch.device) -> int:
    """What the device could still allocate: the driver's free memory and what the caching allocator holds unused."""
    free, _ = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


class KeptActivations:
    """The bounded store (see the module docstring). Thread-safe; `put` and `take` are called by the training
    batcher's requests in the event loop."""

    def __init__(
        self, max_bytes: int, *, keep_s: float = KEEP_S, floor_bytes: int = 0,
        free_bytes: Callable[[], int] | None = None, clock: Callable[[], float] = time.monotonic,
    ) -> None:  # fmt: skip
        if max_bytes < 0 or keep_s <= 0 or floor_bytes < 0:
            raise ValueError(f"max_bytes >= 0, keep_s > 0, floor_bytes >= 0 required, got {max_bytes}, {keep_s}, "
                             f"{floor_bytes}")  # fmt: skip
        self.max_bytes, self.keep_s, self.floor_bytes = max_bytes, keep_s, floor_bytes
        self._free_bytes, self._clock = free_bytes, clock
        self._entries: list[_Entry] = []  # oldest first
        self._lock = threading.Lock()
        self.nbytes = 0
        self.hits = self.misses = self.evictions = 0

    def __len__(self) -> int:
        return len(self._entries)

    def kept_inputs(self) -> list[torch.Tensor]:
        """Every kept block input, oldest entry first (what the store holds on the device)."""
        with self._lock:
            return [tensor for entry in self._entries for tensor in entry.inputs]

    def put(
        self, owner: str, span: tuple[int, ...], adapter: str, hidden: torch.Tensor, prompts: torch.Tensor | None,
        inputs: list[torch.Tensor],
    ) -> bool:  # fmt: skip
        """Keeps a finished forward's block inputs (`inputs`: those of the blocks after the first, [B, T, H] each)
        under its received `hidden` [B, T, H] and `prompts`; False where the bounds leave no room for it."""
        nbytes = _nbytes([hidden, prompts, *inputs])
        with self._lock:
            self._expire()
            if nbytes > self.max_bytes:
                return False
            while self._entries and self.nbytes + nbytes > self.max_bytes:
                self._evict_one()
            device_bytes = _nbytes(list(inputs))
            if self._free_bytes is not None and device_bytes:
                while self._entries and self._free_bytes() - device_bytes < self.floor_bytes:
                    self._evict_one()  # what an evicted entry held returns to the allocator once its tensors go
                if self._free_bytes() - device_bytes < self.floor_bytes:
                    return False
            entry = _Entry(owner, span, adapter, hidden, prompts, list(inputs), nbytes, self._clock())
            self._entries.append(entry)
            self.nbytes += nbytes
        return True

    def take(
        self, owner: str, span: tuple[int, ...], adapter: str, hidden: torch.Tensor, prompts: torch.Tensor | None
    ) -> list[torch.Tensor] | None:
        """The kept block inputs of `owner`'s forward over exactly these received `hidden` and `prompts` (removed
        from the store: one backward per forward), or None."""
        with self._lock:
            self._expire()
            for i, entry in enumerate(self._entries):
                if (
                    entry.owner == owner
                    and entry.span == span
                    and entry.adapter == adapter
                    and _same(entry.hidden, hidden)
                    and _same(entry.prompts, prompts)
                ):
                    del self._entries[i]
                    self.nbytes -= entry.nbytes
                    self.hits += 1
                    return entry.inputs
            self.misses += 1
            return None

    def _expire(self) -> None:
        oldest = self._clock() - self.keep_s
        while self._entries and self._entries[0].kept_at < oldest:
            self.nbytes -= self._entries.pop(0).nbytes
            self.evictions += 1

    def _evict_one(self) -> None:
        """Drops the oldest entry of the owner that holds the most bytes."""
        held: dict[str, int] = {}
        for entry in self._entries:
            held[entry.owner] = held.get(entry.owner, 0) + entry.nbytes
        heaviest = max(held, key=lambda owner: held[owner])
        i = next(i for i, entry in enumerate(self._entries) if entry.owner == heaviest)
        self.nbytes -= self._entries.pop(i).nbytes
        self.evictions += 1
