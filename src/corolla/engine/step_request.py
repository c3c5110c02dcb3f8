"""One inference step of one session as the engine takes it (`StepRequest`): its hidden states as a tensor or only
as their bytes (a device channel's step, staged by a launched forward without a torch call), the position, and what
the engine derives from them once."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from corolla.engine.kv.kv_pool import SequenceSlot
from corolla.engine.kv.session_prefix import SessionPrefix
from corolla.utils.tensor_bytes import HiddenRows, view_bytes


class StepEngine(Protocol):
    """What a step runs on alone (`span_engine.SpanEngine.step`)."""

    def step(
        self,
        session: StepSession,
        hidden: torch.Tensor,
        position: int,
        hypo_ids: torch.Tensor | None,
        prompts: torch.Tensor | None,
    ) -> torch.Tensor: ...


class StepSession(Protocol):
    """What a step reads of its session (`span_engine.EngineSession`, which implements it): named here so that a
    step request knows no engine class (the engine imports this module)."""

    @property
    def engine(self) -> StepEngine: ...

    @property
    def slots(self) -> Sequence[SequenceSlot]: ...

    @property
    def table_rows(self) -> Sequence[memoryview]: ...

    @property
    def batch_size(self) -> int: ...

    @property
    def max_length_tokens(self) -> int: ...

    @property
    def layers(self) -> tuple[int, int]: ...

    @property
    def adapter_index(self) -> int: ...

    @property
    def num_layers(self) -> int: ...

    @property
    def length_tokens(self) -> int: ...

    @property
    def closed(self) -> bool: ...

    @property
    def prefix(self) -> SessionPrefix | None: ...


@dataclass(eq=False, slots=True)  # built per decode step: slots make its init and reads cheaper
class StepRequest:
    """One inference step of one session: hidden [B, T, H] written at [position, position + T); optional beam
    reordering `hypo_ids` [B] and deep `prompts` [session layers, B or 1, P, H].

    The hidden states come as a tensor (`hidden_tensor`), or only as their bytes (`hidden_bytes` with `hidden_dtype`
    and `hidden_shape`: a device channel's decode step, whose launched forward stages the bytes and never needs a
    tensor); `hidden` builds the tensor from the bytes on first use (a view of them)."""

    session: StepSession
    hidden_tensor: torch.Tensor | None
    position: int
    hypo_ids: torch.Tensor | None = None
    prompts: torch.Tensor | None = None
    # the hidden states' bytes in C order, flat, where the caller has them (a device channel's frame copy, which
    # `hidden` views): a launched forward stages them with one memcpy instead of a torch copy (length checked by
    # `check_inputs`)
    hidden_bytes: memoryview | None = None
    hidden_dtype: torch.dtype | None = None  # with `hidden_bytes` and no tensor: their dtype and shape [B, T, H]
    hidden_shape: tuple[int, ...] | None = None
    # where `hidden_bytes` is row `index` of several steps' hidden states in one buffer (a device channel frame's
    # copy): (those rows, index); `hidden` is then that row of one tensor built for all of them
    hidden_rows: tuple[HiddenRows, int] | None = None
    # derived once (read many times per batched step)
    shape: tuple[int, ...] = field(init=False)  # the hidden states' [B, T, H]
    dtype: torch.dtype = field(init=False)  # the hidden states' dtype
    on_cpu: bool = field(init=False)  # the hidden states live on the CPU
    rows: int = field(init=False)
    num_tokens: int = field(init=False)
    needs_prompts: bool = field(init=False)  # deep prompts touch this step's positions
    # the step joins a merged (graph) decode forward as B x T rows, row (b, t) at position + t: a single-token step,
    # or a shadow session's short step marked so by the server (`EngineExecutor.prepare_step`: its T consecutive
    # positions attend to each other through the pool, every row's keys and values written before any row attends)
    is_decode: bool = field(init=False)
    # the output's bytes (C order, flat: what the output tensor views) where a launched forward collected them
    # (`batcher.PendingSteps.wait`): a device channel encodes its reply from them
    output_bytes: memoryview | None = field(default=None, init=False)
    # `SpanEngine.check_inputs` passed (the inputs and the session never change): `validate` checks only the
    # session's state (open, length) then, in the device thread, where it changes
    inputs_checked: bool = field(default=False, init=False)

    def __post_init__(self) -> None:
        tensor = self.hidden_tensor
        if tensor is not None:
            shape: tuple[int, ...] = tensor.shape  # a torch.Size is a tuple
            self.dtype, self.on_cpu = tensor.dtype, tensor.is_cpu
        elif self.hidden_bytes is not None and self.hidden_dtype is not None and self.hidden_shape is not None:
            shape, self.dtype, self.on_cpu = tuple(self.hidden_shape), self.hidden_dtype, True
        else:
            raise ValueError("a step needs its hidden states: a tensor, or their bytes with a dtype and a shape")
        self.shape = shape
        self.rows = int(shape[0]) if len(shape) > 0 else 0
        self.num_tokens = int(shape[1]) if len(shape) > 1 else 0
        p = self.prompts
        self.needs_prompts = p is not None and p.numel() > 0 and p.ndim == 4 and self.position < p.shape[2]
        self.is_decode = self.num_tokens == 1 and not self.needs_prompts

    @classmethod
    def of_bytes(
        cls,
        session: StepSession,
        position: int,
        raw: memoryview,
        dtype: torch.dtype,
        shape: tuple[int, int, int],
        rows: tuple[HiddenRows, int] | None = None,
    ) -> StepRequest:
        """A step given only as its hidden states' bytes [B, T, H] (a device channel's usual step: neither beam ids
        nor prompts): what `StepRequest(session, None, position, hidden_bytes=raw, hidden_dtype=dtype,
        hidden_shape=shape, hidden_rows=rows)` builds, every field set at once instead of through the dataclass init
        and `__post_init__` (built per decode step in the reader thread)."""
        req = object.__new__(cls)
        req.session, req.hidden_tensor, req.position, req.hypo_ids, req.prompts = session, None, position, None, None
        req.hidden_bytes, req.hidden_dtype, req.hidden_shape, req.hidden_rows = raw, dtype, shape, rows
        req.shape, req.dtype, req.on_cpu = shape, dtype, True
        req.rows, req.num_tokens, req.needs_prompts = shape[0], shape[1], False
        req.is_decode = shape[1] == 1
        req.output_bytes, req.inputs_checked = None, False
        return req

    @property
    def hidden(self) -> torch.Tensor:
        """The hidden states [B, T, H] (built from `hidden_bytes` on first use where no tensor was given; call after
        `SpanEngine.check_inputs`, which checks that the bytes' length matches the shape)."""
        tensor = self.hidden_tensor
        if tensor is None:
            rows = self.hidden_rows
            if rows is not None:
                tensor = rows[0].row(rows[1])
            else:
                assert self.hidden_bytes is not None and self.hidden_dtype is not None
                tensor = view_bytes(self.hidden_bytes, self.hidden_dtype, self.shape)
            self.hidden_tensor = tensor
        return tensor

    def run(self) -> torch.Tensor:
        """The step alone on its session's engine (`SpanEngine.step`): [B, T, H] -> [B, T, H]."""
        return self.session.engine.step(self.session, self.hidden, self.position, self.hypo_ids, self.prompts)
