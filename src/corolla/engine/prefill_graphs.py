"""Short prefill chunks of a llama-family span with their per-layer work replayed as CUDA graphs: the next turn of a
conversation whose history is cached computes ~100-250 positions, and eagerly the host spent longer issuing its ~30
operations per layer than the device spent running them (issue 34, docs/decisions/0019).

Between two layers' attention calls everything has static shapes once the chunk's rows are padded to a bucket (8,
16, then multiples of 32 up to `EngineConfig.prefill_graph_tokens`): layer i-1's output projection and MLP
(`FastLlamaSpan.chunk_post`) and layer i's norm, QKV projection, rotation and cache write (`chunk_pre`) are one
graph per boundary, reading and writing static buffers. The attention itself (`chunk_attend`: gather the sequence's
keys and values, flash attention with its lower-right causal mask) runs eagerly in between on the chunk's real
rows: its key count is the sequence's length, and flash attention's variable-length form, the one that takes
lengths from the device, has no split over the keys (4.4 ms against 2.1 ms over 32 Llama-3-8B layers on an H200
when a whole chunk was one graph). Padding rows read position 0 and write only into the pool's trash page.

The graphs of a (layer range, row bucket) group are captured at its first chunk, which runs the same work eagerly;
they share one memory pool (they run one at a time, so each reuses the others' scratch); at most `MAX_GROUPS`
groups are kept (least recently used dropped); `reserved_bytes` is what their captures added to the device's
reserved memory. With `capture=False` (the CPU, in tests) the same work runs eagerly."""

from __future__ import annotations

from collections.abc import Callable

import torch

from corolla.engine.fast_llama import FastLlamaSpan, table_slots
from corolla.engine.kv_pool import TRASH_PAGE, KVPool, SequenceSlot
from corolla.utils.logging import get_logger

logger = get_logger(__name__)

MAX_GROUPS = 8  # (layer range, row bucket) groups of graphs kept: num_layers + 1 graphs each


def chunk_bucket(tokens: int) -> int:
    """The padded row count of a chunk of `tokens` rows: 8, 16, then the next multiple of 32 (GEMM tiles)."""
    if tokens <= 16:
        return 8 if tokens <= 8 else 16
    return -(-tokens // 32) * 32


def graphs_serve(model: object) -> bool:
    """Whether a span's short prefill chunks can run as graphs: a llama-family span on CUDA without adapters or
    routed experts."""
    if not isinstance(model, FastLlamaSpan) or model.device.type != "cuda" or model.adapters is not None:
        return False
    return all(layer.moe is None for layer in model.layers)


class PrefillGraphs:
    """`run(hidden, start, slot, layers)` computes a chunk of at most `max_tokens` rows (see the module docstring).
    Use from one thread (the engine's device thread)."""

    def __init__(self, model: FastLlamaSpan, pool: KVPool, max_tokens: int, *, capture: bool = True):
        if capture and model.device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA span")
        self.model = model
        self.pool = pool
        self.max_tokens = max_tokens
        self.capture = capture
        s, dev, dtype = model.spec, model.device, model.dtype
        rows = chunk_bucket(max_tokens)
        # the static buffers every graph reads and writes: the residual stream [Tmax, H], the rotated queries
        # [Tmax, nq, D], the attention output [Tmax, nq D], positions and cache slots [Tmax] of the rows
        self.h = torch.zeros((rows, s.hidden_size), dtype=dtype, device=dev)
        self.q = torch.zeros((rows, s.num_heads, s.head_dim), dtype=dtype, device=dev)
        self.attn = torch.zeros((rows, s.q_size), dtype=dtype, device=dev)
        self.positions = torch.zeros((rows,), dtype=torch.long, device=dev)
        self.trash_slots = TRASH_PAGE * pool.page_size_tokens + torch.arange(rows, device=dev) % pool.page_size_tokens
        self.slots = self.trash_slots.clone()
        # (first layer, end layer, rows) -> per boundary first..end: a graph's replay (or the eager work), least
        # recently used first
        self._groups: dict[tuple[int, int, int], list[Callable[[], None] | None]] = {}
        self._mempool = torch.cuda.graph_pool_handle() if capture else None
        self.reserved_bytes = 0  # what the captures added to the device's reserved memory
        self.chunks = 0
        self.capture_error: str | None = None  # a capture that failed: later chunks run eagerly

    @property
    def graph_count(self) -> int:
        return sum(len(group) for group in self._groups.values()) if self.capture else 0

    def takes(self, tokens: int) -> bool:
        return 0 < tokens <= self.max_tokens and self.capture_error is None

    @torch.inference_mode()
    def run(self, hidden: torch.Tensor, start: int, slot: SequenceSlot, layers: tuple[int, int]) -> torch.Tensor:
        """hidden [t, H] on the device at positions [start, start + t) of the sequence in `slot` through layers
        [first, end) -> [t, H] (a new tensor)."""
        t = hidden.shape[0]
        total, rows, (first, end) = start + t, chunk_bucket(t), layers
        dev = self.model.device
        table = slot.table.to(dev, non_blocking=True)  # [maxp]
        key_slots = table_slots(table, torch.arange(total, device=dev), self.pool.page_size_tokens)  # [L]
        self.positions[:t].copy_(torch.arange(start, total, device=dev))
        self.positions[t:rows].zero_()
        self.slots[:t].copy_(key_slots[start:])
        self.slots[t:rows].copy_(self.trash_slots[t:rows])  # (rows a longer chunk wrote before)
        self.h[:t].copy_(hidden)
        key = (first, end, rows)
        group = self._groups.pop(key, None)
        if group is None:
            group = [None] * (end - first + 1)
            logger.info(f"prefill_graphs.group(layers={first}:{end}, rows={rows}, capture={self.capture})")
        self._groups[key] = group  # the most recently used last
        while len(self._groups) > MAX_GROUPS:
            self._groups.pop(next(iter(self._groups)))
        for i in range(first, end + 1):
            step = group[i - first]
            if (
                step is None
            ):  # this group's first chunk: the work runs eagerly (compiling its kernels), then is captured
                work = self._work(i, first, end, rows)
                work()
                group[i - first] = self._captured(work, i, rows)
            else:
                step()
            if i < end:
                self.attn[:t].copy_(self.model.chunk_attend(i, self.q[:t], key_slots, self.pool))
        self.chunks += 1
        return self.h[:t].clone()

    def _work(self, i: int, first: int, end: int, rows: int) -> Callable[[], None]:
        """Boundary i's work on the static buffers: layer i-1's `chunk_post` (unless i is the first layer), then
        layer i's `chunk_pre` (unless i is the end)."""
        model, pool = self.model, self.pool
        h, q, attn, positions, slots = self.h[:rows], self.q[:rows], self.attn[:rows], self.positions, self.slots

        def work() -> None:
            if i > first:
                h.copy_(model.chunk_post(i - 1, h, attn))  # [rows, H]
            if i < end:
                q.copy_(model.chunk_pre(i, h, positions[:rows], slots[:rows], pool))  # [rows, nq, D]

        return work

    def _captured(self, work: Callable[[], None], i: int, rows: int) -> Callable[[], None]:
        """`work` as a CUDA graph's replay (or itself, without capture or after a failed capture)."""
        if not self.capture or self.capture_error is not None:
            return work
        dev = self.model.device
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, pool=self._mempool):  # (entering empties the allocator's cache)
                before = torch.cuda.memory_reserved(dev)
                work()
                self.reserved_bytes += torch.cuda.memory_reserved(dev) - before
        except RuntimeError as e:  # (a kernel this device or torch can't capture): serve on, eagerly
            self.capture_error = repr(e)
            logger.warning(f"prefill_graphs.capture_failed(boundary={i}, rows={rows}, error={e!r}): runs eagerly")
            return work
        logger.debug(f"prefill_graphs.capture(boundary={i}, rows={rows}, reserved_bytes={self.reserved_bytes})")
        return graph.replay
