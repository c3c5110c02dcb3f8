"""A merged decode forward on the CUDA-graph path split in two phases, so that the caller (the server's runtime
thread) can stage and launch the next forward while the device still runs this one and its replies are encoded:
`launch_graph_decode` queues the forward and returns a `PendingDecode` at once, whose `wait` waits for that forward
only (not for later forwards queued behind it).

Buffer lifetimes: the graph's static device buffers are reused by the next launch in stream order (its input copies
run after this replay and this output copy). The pinned host buffers are not ordered by the stream: the CPU writes
the inputs and reads the output, so each launch takes one `HostStaging` set of two in turn and first frees it
(`HostStaging.reuse`). With at most one forward pending while the next is launched (the runtime), nothing waits
there in practice. The output is not copied out of its pinned buffer: the replies view it (`HostOutput`)."""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from corolla.engine.graphs.cuda_graphs import DecodeGraphs, InputLayout
from corolla.engine.kv.kv_pool import TRASH_PAGE
from corolla.engine.step_request import StepRequest
from corolla.utils.tensor_bytes import view_bytes

# the most rows of a forward whose waiter spins on the CPU until the device is done (`HostStaging.mark`)
SPIN_MAX_ROWS = 1
# output buffers a staging set keeps besides its own for when replies still view that one (`HostStaging.reuse`)
MAX_SPARE_OUTPUTS = 2


@dataclass(eq=False)
class _RowViews:
    """Views of a bucket's graph inputs (`GraphInputs`) and of one staging set's block laid out alike, for a merged
    forward of `rows` rows in a graph of `bucket` rows, made once per row count (each view is a torch call that may
    hand the GIL to another thread)."""

    inputs: torch.Tensor  # staging block[:hidden_end(rows)]: positions, tables, the live rows' hidden states
    graph_inputs: torch.Tensor  # the bucket's device block, the same bytes
    head: torch.Tensor  # staging block[:hidden_offset]: positions and tables only
    graph_head: torch.Tensor  # the device block's same bytes
    hidden: torch.Tensor  # [rows, H] the staging block's hidden states
    hidden_bytes: memoryview  # their bytes, flat
    graph_rows: torch.Tensor  # [rows, 1, H] the graph's hidden states (a device input's copy goes there)
    positions_np: np.ndarray  # [bucket] int64, in the staging block
    tables_np: np.ndarray  # [bucket, max pages per sequence] int32, in the staging block
    tables_bytes: memoryview  # tables_np's bytes, flat
    adapter_ids: torch.Tensor  # staging.adapter_ids[:bucket]
    bucket: int
    hidden_size: int


@dataclass(eq=False)
class HostOutput:
    """One pinned host buffer that launched forwards copy their output [rows, H] into, lent to the replies as it is
    (`lend`: no copy out). It is free for another forward's output once nothing views the last one lent: each lend
    hands its bytes out through a new array object (`flat[:nbytes]`) that every view made from them keeps alive (a
    memoryview slice, a `TensorBytes`, a tensor from `torch.frombuffer`: CPython's buffer protocol holds the
    exporter), and the buffer keeps only a weak reference to it."""

    out: torch.Tensor  # [rows, H] output, engine dtype
    flat: np.ndarray  # out's bytes, flat uint8
    pinned: bool
    lent: weakref.ref[np.ndarray] | None = None  # the array the last output was lent through (dead: nothing views it)
    row_outs: dict[int, torch.Tensor] = field(default_factory=dict)  # row count -> out[:rows] (made once)

    @classmethod
    def allocate(cls, rows: int, hidden_size: int, dtype: torch.dtype, *, pin_memory: bool = True) -> HostOutput:
        out = torch.empty((rows, hidden_size), dtype=dtype, pin_memory=pin_memory)
        return cls(out=out, flat=out.view(torch.uint8).numpy().reshape(-1), pinned=pin_memory)

    @property
    def viewed(self) -> bool:
        """Whether a view of the last lent output is still alive somewhere (a reply not written yet, a caller's
        tensor)."""
        lent = self.lent
        return lent is not None and lent() is not None

    def rows(self, rows: int) -> torch.Tensor:
        """out[:rows], the destination of a forward's output copy."""
        view = self.row_outs.get(rows)
        if view is None:
            view = self.row_outs[rows] = self.out[:rows]
        return view

    def lend(self, nbytes: int) -> memoryview:
        """The output's first `nbytes` bytes (C order, flat, writable), viewed in place: the buffer is not free until
        this view and every view made from it are gone."""
        array = self.flat[:nbytes]  # a new array object: what `viewed` watches
        self.lent = weakref.ref(array)
        return array.data  # (a memoryview of the array: it holds the array)


@dataclass(eq=False)
class HostStaging:
    """One set of pinned host buffers for a merged forward of up to `rows` rows: one byte `block` holding a bucket's
    graph inputs laid out as the device's (`InputLayout`: one host-to-device copy per forward), the output's buffer
    (`output`, lent to the replies; spares for while they still view it), the adapter ids; flat byte views of what
    the CPU fills per forward (copied with memoryview slice assignments: a memcpy that keeps the GIL); and whether a
    queued copy still reads or writes them (`done`, an event recorded after the last one; None if none)."""

    block: torch.Tensor  # [InputLayout.of(rows, ...).nbytes] uint8: positions, tables, hidden states of one bucket
    output: HostOutput  # where the next forward's output goes ([rows, H], engine dtype)
    adapter_ids: torch.Tensor  # [rows] int64
    adapter_ids_np: np.ndarray
    spares: list[HostOutput] = field(default_factory=list)  # output buffers set aside while replies viewed them
    done: torch.cuda.Event | None = None
    owner: PendingDecode | None = None  # the launched forward whose output `output` holds, not collected yet
    event: torch.cuda.Event | None = None  # recorded anew by each use of the set (made at the first)
    sleeping_event: torch.cuda.Event | None = None  # the same for a forward whose waiter sleeps (`mark(sleep=True)`)
    start: torch.cuda.Event | None = None  # recorded before each use's first copy (the forward's device time)
    views: dict[int, _RowViews] = field(default_factory=dict)  # row count -> views (`row_views`)
    views_of: DecodeGraphs | None = None  # the graphs `views` slice

    @classmethod
    def allocate(
        cls, rows: int, hidden_size: int, max_pages_per_seq: int, dtype: torch.dtype, *, pin_memory: bool = True
    ) -> HostStaging:
        """`pin_memory=False`: plain host memory (the CPU tests of the staging)."""
        nbytes = InputLayout.of(rows, hidden_size, max_pages_per_seq, dtype).nbytes  # the largest bucket's
        block = torch.zeros((nbytes,), dtype=torch.uint8, pin_memory=pin_memory)
        output = HostOutput.allocate(rows, hidden_size, dtype, pin_memory=pin_memory)
        adapter_ids = torch.zeros((rows,), dtype=torch.long, pin_memory=pin_memory)
        return cls(block=block, output=output, adapter_ids=adapter_ids, adapter_ids_np=adapter_ids.numpy())

    @property
    def out(self) -> torch.Tensor:
        """[rows, H]: the buffer the next forward's output goes to."""
        return self.output.out

    def reuse(self) -> None:
        """Waits until no queued copy reads or writes these buffers any more (at once if none does), first collecting
        the output of a forward launched from them and not waited for yet; then makes `output` a buffer that nothing
        views (a spare, or a new one, where the replies still view the last output)."""
        if self.owner is not None:
            self.owner.output_bytes()
        if self.done is not None:
            self.done.synchronize()
            self.done = None
        if self.output.viewed:
            self.output = self._free_output()

    def _free_output(self) -> HostOutput:
        """A spare output buffer that nothing views, else a new one; the viewed one becomes a spare (up to
        `MAX_SPARE_OUTPUTS`; past them it is dropped: its memory lives on as long as its views)."""
        viewed, spares = self.output, self.spares
        free = next((i for i, spare in enumerate(spares) if not spare.viewed), None)
        if free is not None:
            output = spares.pop(free)
        else:
            old = viewed.out
            output = HostOutput.allocate(old.shape[0], old.shape[1], old.dtype, pin_memory=viewed.pinned)
        if len(spares) < MAX_SPARE_OUTPUTS:
            spares.append(viewed)
        return output

    def begin(self, stream: torch.cuda.Stream) -> torch.cuda.Event:
        """Records the set's start event on `stream` before a forward's first copy: the device reaches it when it
        starts that forward (after the forwards queued before it), so `start.elapsed_time(done)` is the forward's own."""
        start = self.start
        if start is None:
            start = self.start = torch.cuda.Event(enable_timing=True)
        start.record(stream)
        return start

    def mark(self, stream: torch.cuda.Stream, *, sleep: bool = False) -> torch.cuda.Event:
        """Records the set's event after the copies just queued on `stream` (the set is busy until it passed).
        `sleep`: a thread waiting for it sleeps until the device signals it (a blocking-sync event) instead of
        spinning on a core: CUDA spins by default, so a thread that waits for every merged forward would be busy
        all the time."""
        if sleep:
            event = self.sleeping_event
            if event is None:
                event = self.sleeping_event = torch.cuda.Event(enable_timing=True, blocking=True)
        else:
            event = self.event
            if event is None:
                event = self.event = torch.cuda.Event(enable_timing=True)
        event.record(stream)
        self.done = event
        return event

    def row_views(self, graphs: DecodeGraphs, rows: int) -> _RowViews:
        """The views a forward of `rows` rows stages and copies through (made at the first forward of that many
        rows): the block is laid out as the bucket's (`graphs.inputs_for(rows).layout`)."""
        if self.views_of is not graphs:
            self.views.clear()
            self.views_of = graphs
        views = self.views.get(rows)
        if views is None:
            target = graphs.inputs_for(rows)
            layout, bucket = target.layout, target.layout.rows
            positions, tables, hidden = layout.views(self.block)  # [bucket], [bucket, P], [bucket, H]
            end = layout.hidden_end(rows)
            views = self.views[rows] = _RowViews(
                inputs=self.block[:end], graph_inputs=target.block[:end],
                head=self.block[: layout.hidden_offset], graph_head=target.block[: layout.hidden_offset],
                hidden=hidden[:rows], hidden_bytes=host_bytes(hidden[:rows]),
                graph_rows=target.hidden[:rows].view(rows, 1, layout.hidden_size),
                positions_np=positions.numpy(), tables_np=tables.numpy(), tables_bytes=host_bytes(tables),
                adapter_ids=self.adapter_ids[:bucket], bucket=bucket,
                hidden_size=layout.hidden_size,
            )  # fmt: skip
        return views


class PendingDecode:
    """A launched merged forward: `output_bytes()` gives its output rows' bytes (a view of the pinned buffer the
    device copied them into: `HostOutput.lend`), `wait()` one output [B_i, T_i, H] per request (CPU tensors viewing
    those bytes). Call them from the launching thread, `wait` once."""

    def __init__(
        self, staging: HostStaging, done: torch.cuda.Event, rows: int, splits: list[int], hidden_size: int,
        dtype: torch.dtype, start: torch.cuda.Event | None = None, shapes: dict[int, tuple[int, ...]] | None = None,
    ):  # fmt: skip
        self._staging: HostStaging | None = staging
        self._output = staging.output  # the buffer this forward's output is copied into
        self._done = done
        self._start = start
        self.device_s: float | None = None  # once collected: the device's seconds from `start` to `done`
        self.rows = rows
        self._splits = splits  # rows per request
        self._shapes = shapes  # request index -> its [B, T, H] where T > 1 (`MergedRows.shapes`)
        self._hidden_size = hidden_size
        self.dtype = dtype  # the output's (the engine's)
        self._data: memoryview | None = None  # the output's bytes [rows, H], once collected
        self._waited = False
        staging.done, staging.owner = done, self

    def output_bytes(self) -> memoryview:
        """Waits for this forward's output copy (not for the forwards queued after it), once, and returns the output
        rows' bytes ([rows, H] in C order, flat) as a view of the pinned buffer they were copied into: no copy, no
        torch call beyond the event's (a launched step's reply is encoded from them, `wait` views them as tensors).
        The staging set is then free for another launch, and its output buffer once nothing views these bytes."""
        data = self._data
        if data is None:
            staging = self._staging
            assert staging is not None
            self._done.synchronize()
            if self._start is not None:
                self.device_s = self._start.elapsed_time(self._done) / 1e3
            data = self._data = self._output.lend(self.rows * self._hidden_size * self.dtype.itemsize)
            if staging.owner is self:
                staging.owner = None
                staging.done = None
            self._staging = None
        return data

    def wait(self) -> list[torch.Tensor]:
        if self._waited:
            raise RuntimeError("PendingDecode.wait called twice")
        self._waited = True
        out = view_bytes(self.output_bytes(), self.dtype, (self.rows, 1, self._hidden_size))  # [rows, 1, H]
        # one split into views: [rows, 1, H] -> [B_i, 1, H] per request ([B_i, T_i, H] where T_i > 1)
        return split_rows(out, self._splits, self._shapes)


def split_rows(out: torch.Tensor, splits: list[int], shapes: dict[int, tuple[int, ...]] | None) -> list[torch.Tensor]:
    """A merged forward's output [rows, 1, H] as one view per request: [B_i, 1, H], or [B_i, T_i, H] for the
    requests of several tokens (`shapes`, None where there are none: no per-request work then)."""
    if len(splits) == 1:  # one request (a lone session's step): no split call
        return [out if not shapes else out.view(shapes[0])]
    pieces = list(out.split(splits))
    if shapes:
        for i, shape in shapes.items():
            pieces[i] = pieces[i].view(shape)
    return pieces


def launch_graph_decode(
    graphs: DecodeGraphs,
    staging: HostStaging,
    group: Sequence[StepRequest],
    *,
    dtype: torch.dtype,
    adapter_rows: torch.Tensor | None,
) -> PendingDecode:
    """Queues one merged forward of `group` (decode steps of distinct sessions over one layer range, hidden
    states on the CPU, at most `graphs.max_rows` rows; validated and prepared by the caller) and returns at once.
    `adapter_rows`: the adapters' per-row index buffer on the device where a row uses an adapter, else None.
    Writes each session's new length (the rows' keys/values are written in stream order before any later step).

    Per forward, the rows' hidden states (where each request carries their bytes: `StepRequest.hidden_bytes`),
    positions and block tables are written into the pinned staging block with memoryview slice assignments (no
    torch call per row), the rows past the live ones up to the graph's bucket are filled there too (no reset kernels
    in `run`), and one host-to-device copy writes all of them into the bucket's graph inputs; the views are made
    once per row count (`HostStaging.row_views`)."""
    merged = merge_rows(group, dtype)
    rows = merged.rows
    staging.reuse()  # the set's previous forward no longer reads its inputs nor writes its output
    views = staging.row_views(graphs, rows)
    h = views.hidden_size
    stream = torch.cuda.current_stream(views.graph_inputs.device)
    if merged.same_dtype and merged.all_bytes:
        stage_hidden_bytes(views.hidden_bytes, group)
    elif merged.same_dtype and not merged.shapes:
        torch.cat([r.hidden for r in group], out=views.hidden.view(rows, 1, h))
    else:
        torch.cat([r.hidden.reshape(-1, h).to(dtype) for r in group], out=views.hidden)
    stage_row_inputs(staging, views, merged, adapter_rows is not None)
    start = staging.begin(stream)  # the device's time on this forward starts at its first copy in
    views.graph_inputs.copy_(views.inputs, non_blocking=True)  # positions, tables, hidden states: one copy
    if adapter_rows is not None:
        adapter_rows[: views.bucket].copy_(views.adapter_ids, non_blocking=True)
    out = graphs.run(rows, group[0].session.layers, adapters=adapter_rows is not None, reset=False)  # [rows, H]
    advance_lengths(group)
    staging.output.rows(rows).copy_(out, non_blocking=True)  # into a buffer nothing views (`staging.reuse`)
    # a lone row's waiter spins (its step's latency); a merged forward's sleeps: its few microseconds of wake-up are
    # nothing beside the forward's milliseconds, and spinning held a core for the whole forward (the runtime
    # thread's CPU per step equalled the wall time per step)
    done = staging.mark(stream, sleep=rows > SPIN_MAX_ROWS)
    return PendingDecode(staging, done, rows, merged.splits, h, dtype, start, merged.shapes)  # (the set's owner)


@dataclass(eq=False)
class MergedRows:
    """A merged decode batch's per-row inputs besides the hidden states, gathered in one pass over its requests."""

    positions: list[int]  # [rows]
    table_rows: list[memoryview]  # [rows] x the bytes of a block table [max_pages_per_seq] int32
    adapter_ids: list[int]  # [rows], 0 = base model
    splits: list[int]  # rows per request
    same_dtype: bool  # every request's hidden states already in the engine's dtype
    all_cpu: bool  # every request's hidden states on the CPU
    all_bytes: bool  # every request carries its hidden states' bytes (`StepRequest.hidden_bytes`)
    shapes: dict[int, tuple[int, ...]] | None = None  # request index -> [B, T, H] for the requests of T > 1 tokens

    @property
    def rows(self) -> int:
        return len(self.positions)

    def tables(self) -> torch.Tensor:
        """The rows' block tables as one new CPU tensor [rows, max_pages_per_seq] int32 (the eager path)."""
        return torch.frombuffer(bytearray().join(self.table_rows), dtype=torch.int32).view(self.rows, -1)


def merge_rows(group: Sequence[StepRequest], dtype: torch.dtype) -> MergedRows:
    """The rows of `group` in request order: a request of B rows and T tokens (`StepRequest.is_decode`) gives B x T
    rows, row (b, t) at position + t over row b's block table (the hidden states' C order)."""
    positions: list[int] = []
    table_rows: list[memoryview] = []
    adapter_ids: list[int] = []
    splits: list[int] = []
    shapes: dict[int, tuple[int, ...]] | None = None
    same_dtype = all_cpu = all_bytes = True
    for i, r in enumerate(group):  # one pass over the merged batch (its flags and lists in locals: once per row)
        same_dtype = same_dtype and r.dtype == dtype
        all_cpu = all_cpu and r.on_cpu
        all_bytes = all_bytes and r.hidden_bytes is not None
        session = r.session
        tokens, rows = r.num_tokens, r.rows
        if tokens == 1 and rows == 1:  # the usual step: one row
            splits.append(1)
            positions.append(r.position)
            table_rows.append(session.table_rows[0])
            adapter_ids.append(session.adapter_index)
            continue
        splits.append(rows * tokens)
        if tokens > 1:
            if shapes is None:
                shapes = {}
            shapes[i] = r.shape
        span = range(r.position, r.position + tokens)
        for table in session.table_rows:
            positions.extend(span)
            table_rows.extend([table] * tokens)
        adapter_ids.extend([session.adapter_index] * (rows * tokens))
    return MergedRows(positions, table_rows, adapter_ids, splits, same_dtype, all_cpu, all_bytes, shapes)


def stage_hidden_bytes(dst: memoryview, group: Sequence[StepRequest]) -> None:
    """Copies the requests' hidden-state bytes (`StepRequest.hidden_bytes`, each [B_i, T_i, H] in the engine's dtype,
    its length checked by `SpanEngine.check_inputs`) one after another to the front of `dst` (a staging set's flat
    bytes): one memcpy per request, with the GIL held."""
    start = 0
    for r in group:
        src = r.hidden_bytes
        assert src is not None
        end = start + len(src)
        dst[start:end] = src  # ValueError (nothing copied) if the lengths disagree
        start = end


def stage_row_inputs(staging: HostStaging, views: _RowViews, merged: MergedRows, adapters: bool) -> None:
    """Writes the rows' positions, block tables and (where `adapters`) adapter ids into `staging`'s pinned buffers
    (free: the caller ran `staging.reuse()`) as `views` lay them out, for the whole bucket: rows past the live ones
    get position 0, the trash page and no adapter (the graph is then run with `reset=False`). No copy to the device:
    the caller queues it (`views.graph_inputs` or `views.graph_head`; `views.adapter_ids`)."""
    rows, bucket = merged.rows, views.bucket
    views.positions_np[:rows] = merged.positions
    tables = b"".join(merged.table_rows)  # the rows' tables in one C loop (GIL held), then one memcpy
    views.tables_bytes[: len(tables)] = tables
    if bucket > rows:
        views.positions_np[rows:bucket] = 0
        views.tables_np[rows:bucket] = TRASH_PAGE
    if adapters:
        staging.adapter_ids_np[:rows] = merged.adapter_ids
        if bucket > rows:
            staging.adapter_ids_np[rows:bucket] = 0


def advance_lengths(group: Sequence[StepRequest]) -> None:
    """Each session's length after its step (its keys/values written in stream order before any later step reads
    them)."""
    for req in group:
        length = req.position + req.num_tokens
        for slot in req.session.slots:
            slot.length_tokens = length


def host_bytes(tensor: torch.Tensor) -> memoryview:
    """A contiguous CPU tensor's bytes as a flat writable memoryview of its memory (no copy)."""
    return tensor.view(torch.uint8).numpy().data.cast("B")
