"""A decode step as bytes, for an executor that sends its work elsewhere as bytes (a handler process's
`ProxyExecutor`): the usual Petals step (hidden states in the block dtype, dummy prompts and beam ids) is checked
on its serialized record and its buffer goes to the channel as it is; the reply's bytes become the output record.
No torch tensor is built for such a step in the handler.

`parse_raw_step` takes only steps that the general path (`block_functions.step_args` + `parse_step_inputs`)
accepts, with the same result (the same prefix length, the same values in the same dtype and shape); for anything
else, a refusal included, it returns None and the general path decodes the step or refuses it with its precise
error. So both paths accept and refuse exactly the same inputs."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple, Protocol

import torch
from hivemind.proto import runtime_pb2

from corolla.protocol.codecs import is_plain_empty, plain_record, raw_record
from corolla.server.block_functions import FLOAT_DTYPES, PETALS_STEP_STRUCTURE, ServingLimits, bytes_finite
from corolla.server.executor import SessionCache

_NONE = int(runtime_pb2.CompressionType.NONE)  # (read once: the enum wrapper's attribute lookup is ~0.7 us)


class RawStep(NamedTuple):
    """A validated decode step's hidden states as bytes: `[B, T, H]` values of the block dtype, finite, T >= 1."""

    prefix_length: int  # the step writes positions [prefix_length, prefix_length + T)
    dtype: torch.dtype  # the block dtype
    shape: tuple[int, int, int]  # (B, T, H)
    data: bytes  # the values in C order, native byte order (the request's buffer)


class RawOutput(NamedTuple):
    """A step's output as the executor received it: dtype, shape and the values' bytes (C order, flat)."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    data: memoryview

    def record(self, dtype: torch.dtype, compression: int) -> runtime_pb2.Tensor | None:
        """The reply record `serialize_tensor(output.to(dtype), compression)` writes, from the bytes; None where
        that takes the tensor (another dtype, a compression, bf16's legacy form)."""
        if self.dtype != dtype or compression != _NONE:
            return None
        return raw_record(dtype, self.shape, bytes(self.data))

    def tensor(self) -> torch.Tensor:
        """The output as a tensor of its own (a copy of the bytes)."""
        if not len(self.data):
            return torch.empty(self.shape, dtype=self.dtype)
        return torch.frombuffer(bytearray(self.data), dtype=self.dtype).view(self.shape)  # [*shape]


class RawStepper(Protocol):
    """An executor that runs a `RawStep` of one of its sessions (`ProxyExecutor`)."""

    async def step_raw(self, cache: SessionCache, step: RawStep, adapter: str, lone_session: bool) -> RawOutput: ...


MAX_KNOWN_EMPTY = 8
_known_empty: list[runtime_pb2.Tensor] = []  # copies of records found plain-empty: a step's dummy prompts, beam ids


def _plain_empty(record: runtime_pb2.Tensor) -> bool:
    """`is_plain_empty(record)`, answered by one comparison for a record equal (every field, unknown ones included)
    to one already found plain-empty: every step of a Petals client carries the same two."""
    for known in _known_empty:
        if record == known:
            return True
    if not is_plain_empty(record):
        return False
    if len(_known_empty) < MAX_KNOWN_EMPTY:
        kept = runtime_pb2.Tensor()
        kept.CopyFrom(record)
        _known_empty.append(kept)
    return True


def parse_raw_step(
    tensors: Sequence[runtime_pb2.Tensor],
    structure: object,
    limits: ServingLimits,
    *,
    batch_size: int,
    current_length: int,
    start_from_position: int | None,
    max_length_tokens: int,
) -> RawStep | None:
    """The usual decode step of a session (see the module docstring) as a `RawStep`; None for anything else."""
    if len(tensors) != 3 or structure != PETALS_STEP_STRUCTURE:  # bounded: lengths compare first
        return None
    hidden, prompts, hypo_ids = tensors
    if not (_plain_empty(prompts) and _plain_empty(hypo_ids)):
        return None
    record = plain_record(hidden)
    if record is None:
        return None
    dtype, shape, data = record
    if dtype != limits.dtype or dtype not in FLOAT_DTYPES or len(shape) != 3:  # the general path casts or refuses
        return None
    step_batch, length, hidden_size = shape
    if hidden_size != limits.hidden_size or step_batch != batch_size or length < 1 or step_batch < 1:
        return None
    if step_batch * length > limits.max_batch_size_tokens:
        return None
    prefix_length = current_length if start_from_position is None else start_from_position
    if not 0 <= prefix_length <= current_length or prefix_length + length > max_length_tokens:
        return None
    if not bytes_finite(data, dtype):
        return None
    return RawStep(prefix_length, dtype, (step_batch, length, hidden_size), data)
