"""Tensors over bytes that a step already holds (a device channel's frame copy): the one place where bytes with a
dtype and a shape become a torch tensor without a copy, zero elements included (`torch.frombuffer` refuses an
empty buffer), the rows of several steps' hidden states in one buffer (`HiddenRows`), and a step's output as the
bytes of its rows in a merged forward's output (`TensorBytes`)."""

from __future__ import annotations

from typing import NamedTuple

import torch


def view_bytes(raw: memoryview, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """A tensor [*shape] of `dtype` viewing `raw` (writable, C order, exactly that many elements: the caller checked
    the length), or a new empty one for zero elements."""
    if raw.nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(raw, dtype=dtype).view(shape)


class HiddenRows:
    """The hidden states of `count` steps of one dtype and shape in one C-order buffer, [count, *shape] (a device
    channel frame's copy; each step holds its slice as `StepRequest.hidden_bytes`). Where the steps need tensors (the
    eager/CPU path), `row(i)` is row i of one tensor viewing the buffer, unbound once for all of them: one
    `frombuffer` and one `unbind` per frame instead of a view per step (the launched forward stages the bytes and
    never calls it)."""

    __slots__ = ("data", "dtype", "shape", "count", "_rows")

    def __init__(self, data: memoryview, dtype: torch.dtype, shape: tuple[int, ...], count: int):
        self.data, self.dtype, self.shape, self.count = data, dtype, shape, count  # data: count x shape elements
        self._rows: tuple[torch.Tensor, ...] | None = None

    def row(self, index: int) -> torch.Tensor:
        """Step `index`'s hidden states [*shape], a view of its bytes in the buffer (writable)."""
        rows = self._rows
        if rows is None:
            rows = self._rows = view_bytes(self.data, self.dtype, (self.count, *self.shape)).unbind(0)
        return rows[index]


class TensorBytes(NamedTuple):
    """A tensor [*shape] of `dtype` on the CPU given as its bytes (C order, flat), with no tensor built: a launched
    decode step's output, its rows' bytes in the merged forward's one copy of the output (`StepRequest.output_bytes`).
    A reply is encoded from `data` (no torch call per step on the device thread or in the front); `tensor()` views
    them for a caller that needs a tensor. `shape`, `dtype` and `is_cpu` read as a CPU tensor's do."""

    data: memoryview
    dtype: torch.dtype
    shape: tuple[int, ...]
    is_cpu: bool = True

    def tensor(self) -> torch.Tensor:
        """A tensor viewing `data` (writable)."""
        return view_bytes(self.data, self.dtype, self.shape)


def as_tensor(output: torch.Tensor | TensorBytes) -> torch.Tensor:
    """A step's output as a tensor: itself, or a view of its bytes (`TensorBytes.tensor`)."""
    return output.tensor() if isinstance(output, TensorBytes) else output
