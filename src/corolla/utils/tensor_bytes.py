"""A tensor over bytes that a step already holds (a device channel's frame copy): the one place where bytes with a
dtype and a shape become a torch tensor without a copy, zero elements included (`torch.frombuffer` refuses an
empty buffer)."""

from __future__ import annotations

import torch


def view_bytes(raw: memoryview, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """A tensor [*shape] of `dtype` viewing `raw` (writable, C order, exactly that many elements: the caller checked
    the length), or a new empty one for zero elements."""
    if raw.nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(raw, dtype=dtype).view(shape)
