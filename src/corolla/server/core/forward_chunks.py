"""Long forwards as many short runtime tasks: one block at a time and, without deep prompts, at most
`chunk_tokens` tokens at a time (each chunk attends to the earlier ones through a temporary KV cache of that block,
like a chunked prefill). Each task is queued on its own, so inference steps (more urgent) run between them and
concurrent forwards take turns, instead of waiting behind one long task."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import torch

from corolla.server.backend import SpanBackend
from corolla.server.core.runtime import KIND_FORWARD, PRIORITY_FORWARD, Runtime
from corolla.server.metrics import ServerMetrics


def plan_token_chunks(length: int, batch_size: int, chunk_tokens: int) -> list[tuple[int, int]]:
    """`[start, end)` token ranges with `batch_size * (end - start) <= chunk_tokens` (at least one token each)."""
    step = max(1, chunk_tokens // max(1, batch_size))
    return [(start, min(length, start + step)) for start in range(0, length, step)]


async def run_forward_chunked(
    backend: SpanBackend,
    runtime: Runtime,
    block_indices: list[int],
    hidden: torch.Tensor,
    prompts: torch.Tensor | None,
    *,
    active_adapter: str,
    chunk_tokens: int,
    metrics: ServerMetrics | None = None,
) -> torch.Tensor:
    """The same result as `backend.forward(block_indices, hidden, prompts, adapter)` ([B, T, H]) computed as
    several runtime tasks, each reporting its queue wait and its tokens to `metrics` (its seconds and steps: the
    runtime's batch counts).

    All tasks are queued at once, in an order where each one's inputs come from tasks queued before it (chunk by
    chunk, block by block within a chunk): the runtime runs tasks of one priority oldest first, so no task waits
    for a round trip through the event loop, and more urgent tasks still run between any two of them."""
    batch_size, length, _ = hidden.shape
    # token chunks use temporary per-block caches; deep prompts and adapters go block by block, whole
    split_tokens = prompts is None and not active_adapter
    chunks = plan_token_chunks(length, batch_size, chunk_tokens) if split_tokens else [(0, length)]
    # results[(position, chunk)]: that block's output for that chunk, until the next block read it; written and read
    # in the device thread only
    results: dict[tuple[int, int], torch.Tensor] = {}
    caches: dict[int, list[torch.Tensor]] = {position: [] for position in range(len(block_indices))}

    def block_task(position: int, index: int, k: int, start: int, end: int) -> Callable[[], torch.Tensor]:
        def task() -> torch.Tensor:
            if len(chunks) == 1:  # the whole block, with its deep prompts and the adapter
                inputs = hidden if position == 0 else results.pop((position - 1, 0))
                block_prompts = None if prompts is None else prompts[position : position + 1]
                output = backend.forward([index], inputs, block_prompts, active_adapter)
            else:  # one token chunk through the block's temporary cache (made on first use, freed with the request)
                inputs = hidden[:, start:end] if position == 0 else results.pop((position - 1, k))
                cache = caches[position]
                if not cache:
                    for d in backend.cache_descriptors([index], inputs.shape[0], length)[0]:
                        cache.append(torch.zeros(tuple(d.shape), dtype=d.dtype, device=d.device))
                output = backend.cached_forward(index, inputs, cache, start)
            results[(position, k)] = output
            return output

        return task

    futures = []
    for k, (start, end) in enumerate(chunks):
        for position, index in enumerate(block_indices):
            size = batch_size * (end - start)
            fn = _measured(block_task(position, index, k, start, end), metrics, size)
            futures.append(runtime.submit(fn, priority=PRIORITY_FORWARD, size_tokens=size, kind=KIND_FORWARD))
    try:
        await asyncio.gather(*futures)
    finally:
        for future in futures:
            future.cancel()  # after a failure: the rest is skipped by the runtime (no-op for finished ones)
    last = len(block_indices) - 1
    outputs = [results[(last, k)] for k in range(len(chunks))]
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=1)


def _measured(
    fn: Callable[[], torch.Tensor], metrics: ServerMetrics | None, num_tokens: int
) -> Callable[[], torch.Tensor]:
    if metrics is None:
        return fn
    submitted = time.perf_counter()

    def task() -> torch.Tensor:
        metrics.queue_wait(time.perf_counter() - submitted)
        result = fn()
        metrics.tokens("forward", num_tokens)
        return result

    return task
