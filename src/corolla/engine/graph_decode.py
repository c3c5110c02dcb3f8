"""A merged decode forward on the CUDA-graph path split in two phases, so that the caller (the server's runtime
thread) can stage and launch the next forward while the device still runs this one and its replies are encoded:

- `launch_graph_decode` stages the rows' inputs in pinned host buffers, queues their host-to-device copies, the
  graph replay and the device-to-host copy of the output on the current stream, records an event, and returns a
  `PendingDecode` at once;
- `PendingDecode.wait` waits for that event only (not for later forwards queued behind it), copies the output out
  of the pinned buffer and splits it per request.

Buffer lifetimes: the graph's static device buffers are reused by the next launch in stream order (its input copies
run after this replay and this output copy). The pinned host buffers are not ordered by the stream: the CPU writes
the inputs and reads the output, so each launch takes one `HostStaging` set of two in turn and first frees it: it
copies out the output of the forward last launched from it if nobody has waited for it yet, and waits for the set's
last event (a launch never overwrites inputs that a queued copy has not read yet, nor an output not copied out
yet). With at most one forward pending while the next is launched (the runtime), nothing waits there in practice."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from corolla.engine.cuda_graphs import DecodeGraphs

if TYPE_CHECKING:
    from corolla.engine.span_engine import StepRequest


@dataclass(eq=False)
class HostStaging:
    """One set of pinned host buffers for a merged forward of up to `rows` rows, and the event recorded after the
    last queued copy that reads or writes them (None before first use)."""

    hidden: torch.Tensor  # [rows, H] inputs, engine dtype
    out: torch.Tensor  # [rows, H] output, engine dtype
    positions: torch.Tensor  # [rows] int64
    positions_np: np.ndarray
    tables: torch.Tensor  # [rows, max pages per sequence] int32
    adapter_ids: torch.Tensor  # [rows] int64
    adapter_ids_np: np.ndarray
    done: torch.cuda.Event | None = None
    owner: PendingDecode | None = None  # the launched forward whose output `out` holds, not copied out yet

    @classmethod
    def allocate(cls, rows: int, hidden_size: int, max_pages_per_seq: int, dtype: torch.dtype) -> HostStaging:
        positions = torch.empty((rows,), dtype=torch.long, pin_memory=True)
        adapter_ids = torch.empty((rows,), dtype=torch.long, pin_memory=True)
        return cls(
            hidden=torch.empty((rows, hidden_size), dtype=dtype, pin_memory=True),
            out=torch.empty((rows, hidden_size), dtype=dtype, pin_memory=True),
            positions=positions,
            positions_np=positions.numpy(),
            tables=torch.empty((rows, max_pages_per_seq), dtype=torch.int32, pin_memory=True),
            adapter_ids=adapter_ids,
            adapter_ids_np=adapter_ids.numpy(),
        )

    def reuse(self) -> None:
        """Waits until no queued copy reads or writes these buffers any more (at once if none does), first copying
        out the output of a forward launched from them and not waited for yet."""
        if self.owner is not None:
            self.owner.collect()
        if self.done is not None:
            self.done.synchronize()
            self.done = None


class PendingDecode:
    """A launched merged forward: `wait()` returns one output [B_i, 1, H] per request (CPU tensors that own their
    memory: views of one fresh copy of the output rows). Call `wait` once, from the launching thread."""

    def __init__(self, staging: HostStaging, done: torch.cuda.Event, rows: int, splits: list[int], hidden_size: int):
        self._staging: HostStaging | None = staging
        self._done = done
        self.rows = rows
        self._splits = splits  # rows per request
        self._hidden_size = hidden_size
        self._out: torch.Tensor | None = None  # [rows, H], once copied out
        self._waited = False
        staging.done, staging.owner = done, self

    def collect(self) -> torch.Tensor:
        """Waits for this forward's output copy (not for the forwards queued after it) and copies the rows out of
        the pinned buffer, once; the buffer is then free for another launch. Returns [rows, H]."""
        if self._out is None:
            staging = self._staging
            assert staging is not None
            self._done.synchronize()
            # one single-threaded copy: numpy's memcpy rather than torch's intra-op parallel copy, whose thread
            # wake-ups cost more than the copy of a few hundred KiB
            host = staging.out[: self.rows]  # [rows, H]
            out = torch.empty(host.shape, dtype=host.dtype)
            _copy_rows(out, host)
            self._out = out
            if staging.owner is self:
                staging.owner = None
                staging.done = None
            self._staging = None
        return self._out

    def wait(self) -> list[torch.Tensor]:
        if self._waited:
            raise RuntimeError("PendingDecode.wait called twice")
        self._waited = True
        out = self.collect()
        # one split into views: [rows, H] -> [B_i, 1, H] per request
        return list(out.view(self.rows, 1, self._hidden_size).split(self._splits))


def launch_graph_decode(
    graphs: DecodeGraphs,
    staging: HostStaging,
    group: Sequence[StepRequest],
    *,
    dtype: torch.dtype,
    adapter_rows: torch.Tensor | None,
) -> PendingDecode:
    """Queues one merged forward of `group` (single-token steps of distinct sessions over one layer range, hidden
    states on the CPU, at most `graphs.max_rows` rows; validated and prepared by the caller) and returns at once.
    `adapter_rows`: the adapters' per-row index buffer on the device where a row uses an adapter, else None.
    Writes each session's new length (the rows' keys/values are written in stream order before any later step)."""
    h = graphs.hidden.shape[1]
    merged = merge_rows(group, dtype)
    rows = merged.rows
    staging.reuse()  # the set's previous forward no longer reads its inputs nor writes its output
    staged = staging.hidden[:rows]  # [rows, H]
    if merged.same_dtype:
        torch.cat([r.hidden for r in group], out=staged.view(rows, 1, h))
    else:
        torch.cat([r.hidden.reshape(r.rows, h).to(dtype) for r in group], out=staged)
    graphs.hidden[:rows].copy_(staged, non_blocking=True)
    stage_row_inputs(graphs, staging, merged, adapter_rows)
    out = graphs.run(rows, group[0].session.layers, adapters=adapter_rows is not None)  # [rows, H], static buffer
    advance_lengths(group)
    staging.out[:rows].copy_(out, non_blocking=True)
    done = torch.cuda.Event()
    done.record(torch.cuda.current_stream(graphs.hidden.device))
    return PendingDecode(staging, done, rows, merged.splits, h)  # the set's owner until its output is copied out


@dataclass(eq=False)
class MergedRows:
    """A merged decode batch's per-row inputs besides the hidden states, gathered in one pass over its requests."""

    positions: list[int]  # [rows]
    tables: list[torch.Tensor]  # [rows] x [max_pages_per_seq]
    adapter_ids: list[int]  # [rows], 0 = base model
    splits: list[int]  # rows per request
    same_dtype: bool  # every request's hidden states already in the engine's dtype
    all_cpu: bool  # every request's hidden states on the CPU

    @property
    def rows(self) -> int:
        return len(self.positions)


def merge_rows(group: Sequence[StepRequest], dtype: torch.dtype) -> MergedRows:
    """The rows of `group` (single-token steps; a request of B rows gives B rows) in request order."""
    merged = MergedRows([], [], [], [], True, True)
    for r in group:  # one pass over the merged batch
        hidden = r.hidden
        merged.same_dtype = merged.same_dtype and hidden.dtype == dtype
        merged.all_cpu = merged.all_cpu and hidden.is_cpu
        merged.splits.append(r.rows)
        if r.rows == 1:
            merged.positions.append(r.position)
            merged.tables.append(r.session.slots[0].table)
            merged.adapter_ids.append(r.session.adapter_index)
        else:
            merged.positions.extend([r.position] * r.rows)
            merged.tables.extend(slot.table for slot in r.session.slots)
            merged.adapter_ids.extend([r.session.adapter_index] * r.rows)
    return merged


def stage_row_inputs(
    graphs: DecodeGraphs, staging: HostStaging, merged: MergedRows, adapter_rows: torch.Tensor | None
) -> None:
    """Queues the copies of the rows' positions, block tables and (where `adapter_rows`, the adapters' per-row
    index buffer on the device, is given) adapter ids into the graphs' static inputs, through `staging`'s pinned
    buffers (free: the caller ran `staging.reuse()`)."""
    rows = merged.rows
    staging.positions_np[:rows] = merged.positions
    torch.stack(merged.tables, out=staging.tables[:rows])
    graphs.positions[:rows].copy_(staging.positions[:rows], non_blocking=True)
    graphs.block_tables[:rows].copy_(staging.tables[:rows], non_blocking=True)
    if adapter_rows is not None:
        staging.adapter_ids_np[:rows] = merged.adapter_ids
        adapter_rows[:rows].copy_(staging.adapter_ids[:rows], non_blocking=True)


def advance_lengths(group: Sequence[StepRequest]) -> None:
    """Each session's length after its single-token step (its key/value written in stream order before any later
    step reads it)."""
    for req in group:
        length = req.position + 1
        for slot in req.session.slots:
            slot.length_tokens = length


def _copy_rows(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst[...] = src for contiguous CPU tensors of one shape and dtype, as one memcpy in this thread."""
    if dst.dtype.itemsize == 2:  # bfloat16 has no numpy dtype: copy its bits
        np.copyto(dst.view(torch.int16).numpy(), src.view(torch.int16).numpy())
    else:
        np.copyto(dst.view(torch.uint8).numpy(), src.view(torch.uint8).numpy())
