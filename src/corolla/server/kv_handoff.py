"""A session's KV cache in the canonical hand-off layout (`protocol.handoff`): read out of the plain path's
`MemoryCache` tensors for export, and validated (as hostile input) and written into a new session's cache for
import. Both run as runtime tasks (the device thread owns the cache). The GPU fast path's paged pool and tensor-
parallel blocks are not supported: `check_supported` refuses them, and the client falls back to a replay."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from corolla.server.block_functions import all_finite
from corolla.server.task import KIND_GENERIC, PRIORITY_INFERENCE

KV_TENSORS_PER_BLOCK = 2  # K and V
LENGTH_DIM = 2  # [B, kv_heads, max_length, head_dim]


class HandoffUnsupported(ValueError):
    """This server's cache can't be exported or imported (fast path, tensor parallel): the client replays instead."""


def check_supported(backend: Any, memory_cache: Any, descriptors_per_block: Sequence[Sequence[Any]]) -> None:
    """Refuses caches that are not one K and one V `[B, kv_heads, max_length, head_dim]` tensor per block."""
    if hasattr(backend, "submit_inference_step") or not hasattr(memory_cache, "use_cache"):
        raise HandoffUnsupported("KV hand-off is not supported on the GPU fast path (paged KV pool)")
    for descriptors in descriptors_per_block:
        if len(descriptors) != KV_TENSORS_PER_BLOCK or any(len(d.shape) != 4 for d in descriptors):
            raise HandoffUnsupported("KV hand-off needs one K and one V [B, kv_heads, length, head_dim] per block")


def expected_shapes(descriptors_per_block: Sequence[Sequence[Any]], position: int) -> list[tuple[torch.Size, Any]]:
    """(shape, dtype) of each canonical tensor for `position` tokens, from this server's own descriptors."""
    result = []
    for descriptors in descriptors_per_block:
        for d in descriptors:
            shape = list(d.shape)
            shape[LENGTH_DIM] = position
            result.append((torch.Size(shape), d.dtype))
    return result


def canonical_nbytes(descriptors_per_block: Sequence[Sequence[Any]], position: int) -> int:
    """Raw bytes of the canonical tensors of `position` tokens (what an import must carry, exactly)."""
    return sum(math.prod(shape) * dtype.itemsize for shape, dtype in expected_shapes(descriptors_per_block, position))


def read_kv(memory_cache: Any, cache_handles: Sequence[Sequence[int]], position: int) -> list[torch.Tensor]:
    """Runtime thread: copies of the first `position` tokens of every block's K and V, on the CPU."""
    result = []
    for handles in cache_handles:
        for tensor in memory_cache.use_cache(*handles):  # [B, kv, max_length, hd]
            result.append(tensor[:, :, :position].to("cpu", copy=True).contiguous())
    return result


def validate_import(
    tensors: Sequence[torch.Tensor], descriptors_per_block: Sequence[Sequence[Any]], position: int
) -> None:
    """ValueError unless `tensors` are exactly this session's canonical K/V for `position` tokens: count, shape,
    dtype (the block's, no cast) and finite values."""
    expected = expected_shapes(descriptors_per_block, position)
    if len(tensors) != len(expected):
        raise ValueError(f"KV import has {len(tensors)} tensors, expected {len(expected)} (K and V per block)")
    for i, (tensor, (shape, dtype)) in enumerate(zip(tensors, expected, strict=True)):
        if tensor.shape != shape or tensor.dtype != dtype:
            raise ValueError(
                f"KV import tensor {i} is {tensor.dtype} {list(tensor.shape)}, expected {dtype} {list(shape)}"
            )
        if not all_finite(tensor):
            raise ValueError(f"KV import tensor {i} contains NaN or infinite values")


def write_kv(
    memory_cache: Any, cache_handles: Sequence[Sequence[int]], tensors: Sequence[torch.Tensor], position: int
) -> None:
    """Runtime thread: writes validated canonical tensors into positions `[0, position)` of the session's cache."""
    flat = [t for handles in cache_handles for t in memory_cache.use_cache(*handles)]
    assert len(flat) == len(tensors), "validate_import checked the tensor count"
    for cache, tensor in zip(flat, tensors, strict=True):
        cache[:, :, :position].copy_(tensor)


async def run_on_runtime(runtime: Any, fn: Any) -> Any:
    """Runs `fn` as a runtime task at inference priority (the cache belongs to the device thread); a copy of the
    cache is no compute, so it counts as one token of the batch budget."""
    return await runtime.submit(fn, priority=PRIORITY_INFERENCE, size_tokens=1, kind=KIND_GENERIC)
