"""Long forwards as many short runtime tasks: one block at a time and, without deep prompts, at most
`chunk_tokens` tokens at a time (each chunk attends to the earlier ones through a temporary KV cache of that block,
like a chunked prefill). Each task is queued on its own, so inference steps (more urgent) run between them and
concurrent forwards take turns, instead of waiting behind one long task."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from corolla.server.task import KIND_FORWARD, PRIORITY_FORWARD


def plan_token_chunks(length: int, batch_size: int, chunk_tokens: int) -> list[tuple[int, int]]:
    """`[start, end)` token ranges with `batch_size * (end - start) <= chunk_tokens` (at least one token each)."""
    step = max(1, chunk_tokens // max(1, batch_size))
    return [(start, min(length, start + step)) for start in range(0, length, step)]


def can_split_tokens(backend: Any, prompts: torch.Tensor | None, adapter: str) -> bool:
    """Token chunks need the plain backend's per-block cache path; deep prompts and adapters go block by block."""
    return (
        prompts is None
        and not adapter
        and hasattr(backend, "inference_step")
        and hasattr(backend, "cache_descriptors")
        and not hasattr(backend, "submit_inference_step")  # the GPU fast path keeps its own cache pool
    )


async def run_forward_chunked(
    backend: Any,
    runtime: Any,
    block_indices: list[int],
    hidden: torch.Tensor,
    prompts: torch.Tensor | None,
    *,
    active_adapter: str,
    chunk_tokens: int,
    measured: Callable[[Callable[[], Any], int], Callable[[], Any]],
) -> torch.Tensor:
    """The same result as `backend.forward(block_indices, hidden, prompts, adapter)` ([B, T, H]) computed as
    several runtime tasks. `measured(fn, num_tokens)` wraps each task for metrics."""
    batch_size, length, _ = hidden.shape
    split_tokens = can_split_tokens(backend, prompts, active_adapter)
    chunks = plan_token_chunks(length, batch_size, chunk_tokens) if split_tokens else [(0, length)]
    for position, index in enumerate(block_indices):
        block_prompts = None if prompts is None else prompts[position : position + 1]
        if len(chunks) == 1:
            hidden = await _submit(
                runtime,
                measured(_whole_block(backend, index, hidden, block_prompts, active_adapter), batch_size * length),
                batch_size * length,
            )
            continue
        cache: list[torch.Tensor] = []  # this block's keys/values of the tokens done so far (device thread only)
        outputs = []
        for start, end in chunks:
            task = _cached_chunk(backend, index, hidden[:, start:end], cache, start, length)
            outputs.append(
                await _submit(runtime, measured(task, batch_size * (end - start)), batch_size * (end - start))
            )
        cache.clear()
        hidden = torch.cat(outputs, dim=1)
    return hidden


def _whole_block(
    backend: Any, index: int, hidden: torch.Tensor, prompts: torch.Tensor | None, adapter: str
) -> Callable[[], torch.Tensor]:
    return lambda: backend.forward([index], hidden, prompts, adapter)


def _cached_chunk(
    backend: Any, index: int, hidden: torch.Tensor, cache: list[torch.Tensor], start: int, length: int
) -> Callable[[], torch.Tensor]:
    def task() -> torch.Tensor:
        if not cache:  # created in the device thread on first use; freed with the request
            for d in backend.cache_descriptors([index], hidden.shape[0], length)[0]:
                cache.append(torch.zeros(tuple(d.shape), dtype=d.dtype, device=d.device))
        return backend.inference_step([index], hidden, [cache], prefix_length=start, max_length=length)

    return task


async def _submit(runtime: Any, fn: Callable[[], Any], size_tokens: int) -> Any:
    return await runtime.submit(fn, priority=PRIORITY_FORWARD, size_tokens=size_tokens, kind=KIND_FORWARD)
