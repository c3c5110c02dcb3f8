"""A session's KV cache in the canonical hand-off layout (`protocol.handoff`): the expected tensors of a session's layout
and the validation of an import (hostile input) against them. Reading and writing the cache are the executor's; one
that can't raises `executor.HandoffUnsupported` and the client replays instead."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from corolla.models.block_base import TensorDescriptor
from corolla.server.core.executor import HandoffUnsupported
from corolla.utils.finite import all_finite

LENGTH_DIM = 2  # [B, kv_heads, max_length, head_dim]

__all__ = ["HandoffUnsupported", "canonical_nbytes", "check_handoff_frame", "expected_shapes", "validate_import"]


def expected_shapes(
    descriptors_per_block: Sequence[Sequence[TensorDescriptor]], position: int
) -> list[tuple[torch.Size, torch.dtype]]:
    """(shape, dtype) of each canonical tensor for `position` tokens, from this server's own descriptors."""
    result = []
    for descriptors in descriptors_per_block:
        for d in descriptors:
            shape = list(d.shape)
            shape[LENGTH_DIM] = position
            result.append((torch.Size(shape), d.dtype))
    return result


def canonical_nbytes(descriptors_per_block: Sequence[Sequence[TensorDescriptor]], position: int) -> int:
    """Raw bytes of the canonical tensors of `position` tokens (what an import must carry, exactly)."""
    return sum(math.prod(shape) * dtype.itemsize for shape, dtype in expected_shapes(descriptors_per_block, position))


def validate_import(
    tensors: Sequence[torch.Tensor], descriptors_per_block: Sequence[Sequence[TensorDescriptor]], position: int
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


HANDOFF_FRAME_SLACK_BYTES = 1 << 16  # a hand-off frame's records and state beside its tensors' bytes


def check_handoff_frame(tensors: list[torch.Tensor], max_frame_bytes: int) -> None:
    """HandoffUnsupported (the client replays) where a session's cache does not fit one handler channel frame
    (`protocol.channel_frames`)."""
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    if len(tensors) > 255 or nbytes + HANDOFF_FRAME_SLACK_BYTES > max_frame_bytes:
        raise HandoffUnsupported(
            f"a KV hand-off of {len(tensors)} tensors, {nbytes} bytes, exceeds the handler channel's frame of "
            f"{max_frame_bytes} bytes: the client replays"
        )
