"""The host side of a launched merged forward (`engine.graph_decode`), on the CPU with plain buffers standing in for
the pinned ones and the graphs' static inputs: rows staged from their bytes (`StepRequest.hidden_bytes`, a device
channel's frame copy) and block tables with memoryview copies equal what `torch.cat`/`torch.stack` give, the
bucket's rows past the live ones point at the trash page, one copy of the staging block writes a bucket's graph
inputs (positions, tables, the live rows' hidden states) and no other bucket's, the block's layout (aligned parts,
hidden states last), views are made once per row count, the collected output
owns its memory, a staging set's output buffer is lent to the replies and not written again while any view of it
lives, a merged output is one view per request in its shape (one request too: no split call); a step's bytes that disagree with its hidden states are refused where the step enters; a STEP_BATCH
step's bytes are the memory its hidden states view."""

from __future__ import annotations

import pytest
import torch
from tests.helpers.channel_frames import batch_payload

from corolla.engine import EngineConfig, SpanEngine
from corolla.engine.graph_decode import (
    MAX_SPARE_OUTPUTS,
    HostStaging,
    PendingDecode,
    merge_rows,
    split_rows,
    stage_hidden_bytes,
    stage_row_inputs,
)
from corolla.engine.graphs.cuda_graphs import GraphInputs, InputLayout
from corolla.engine.kv.kv_pool import TRASH_PAGE
from corolla.engine.span_engine import StepRequest
from corolla.models.registry import get_family
from corolla.protocol import channel_frames
from corolla.protocol import channel_frames as wire
from corolla.utils.tensor_bytes import TensorBytes
from helpers.tiny_models import tiny_config

H = 64  # tiny_config hidden size


class _Graphs:
    """`DecodeGraphs`' static inputs (CPU blocks, every byte marked: positions 99, tables 55, hidden states 7) and its
    bucket rule, nothing else."""

    def __init__(self, max_rows: int, pages: int, dtype: torch.dtype):
        self.buckets = (1, 2, 4, max_rows)
        self.inputs = {b: GraphInputs.allocate(InputLayout.of(b, H, pages, dtype), torch.device("cpu"))
                       for b in self.buckets}  # fmt: skip
        for inputs in self.inputs.values():
            inputs.positions.fill_(99)
            inputs.block_tables.fill_(55)
            inputs.hidden.fill_(7.0)

    def bucket_for(self, rows: int) -> int:
        return next(b for b in self.buckets if b >= rows)

    def inputs_for(self, rows: int) -> GraphInputs:
        return self.inputs[self.bucket_for(rows)]


def _engine(dtype: torch.dtype = torch.float32) -> SpanEngine:
    torch.manual_seed(0)
    config = tiny_config("llama", 2)
    blocks = [get_family(config).build_block(config, i).to(dtype) for i in range(2)]
    settings = dict(kv_pool_bytes=2 << 20, page_size_tokens=16, max_seq_len_tokens=128, max_batch_rows=8)
    return SpanEngine.from_blocks(blocks, EngineConfig(**settings))


def _with_bytes(session, hidden: torch.Tensor, position: int) -> StepRequest:
    copy = bytearray(hidden.contiguous().view(torch.uint8).numpy().tobytes())
    tensor = torch.frombuffer(copy, dtype=hidden.dtype).view(hidden.shape)
    return StepRequest(session, tensor, position, hidden_bytes=memoryview(copy))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_and_tables_staged_from_bytes_equal_cat_and_stack(dtype: torch.dtype, monkeypatch) -> None:
    engine = _engine(dtype)
    sessions = [engine.open_session(b, 64) for b in (1, 2, 1)]
    requests = [_with_bytes(s, torch.randn(s.batch_size, 1, H).to(dtype), 3 + i) for i, s in enumerate(sessions)]
    want_hidden = torch.cat([r.hidden for r in requests]).view(4, H)
    want_tables = torch.stack([slot.table for s in sessions for slot in s.slots])
    pages = engine.pool.max_pages_per_seq
    graphs = _Graphs(8, pages, dtype)
    staging = HostStaging.allocate(8, H, pages, dtype, pin_memory=False)
    staging.block.fill_(123)  # an earlier forward's bytes: the padding must not keep them

    def forbidden(*args, **kwargs):
        raise AssertionError("rows are staged without torch.cat / torch.stack")

    monkeypatch.setattr(torch, "cat", forbidden)
    monkeypatch.setattr(torch, "stack", forbidden)
    merged = merge_rows(requests, dtype)
    assert merged.all_bytes and merged.same_dtype and merged.rows == 4 and merged.splits == [1, 2, 1]
    part = requests[1:]  # 3 live rows in a bucket of 4
    views = staging.row_views(graphs, 3)
    stage_hidden_bytes(views.hidden_bytes, part)
    stage_row_inputs(staging, views, merge_rows(part, dtype), False)
    views.graph_inputs.copy_(views.inputs)  # the step's one copy: positions, tables, the live rows' hidden states
    monkeypatch.undo()
    four = graphs.inputs[4]
    assert views.bucket == 4 and torch.equal(views.hidden, want_hidden[1:])
    assert torch.equal(four.hidden[:3], want_hidden[1:]) and (four.hidden[3] == 7).all()  # past the live rows
    assert four.positions.tolist() == [4, 4, 5, 0]
    assert torch.equal(four.block_tables[:3], want_tables[1:]) and (four.block_tables[3] == TRASH_PAGE).all()
    for bucket in (1, 2, 8):  # the other buckets' inputs are not written
        assert (graphs.inputs[bucket].positions == 99).all() and (graphs.inputs[bucket].block_tables == 55).all()
    assert staging.row_views(graphs, 3) is views  # made once per row count
    views = staging.row_views(graphs, 4)
    stage_hidden_bytes(views.hidden_bytes, requests)
    stage_row_inputs(staging, views, merged, False)
    views.graph_inputs.copy_(views.inputs)
    assert torch.equal(four.hidden, want_hidden)
    assert torch.equal(four.block_tables, want_tables) and four.positions.tolist() == [3, 4, 4, 5]
    assert torch.equal(merged.tables(), want_tables)  # the eager path's tables
    # 5 rows in the bucket of 8, hidden states already on the device: the head copy writes positions and tables only
    eight = graphs.inputs[8]
    views = staging.row_views(graphs, 5)
    stage_row_inputs(staging, views, merge_rows(requests + requests[:1], dtype), False)
    views.graph_head.copy_(views.head)
    assert eight.positions.tolist() == [3, 4, 4, 5, 3, 0, 0, 0] and (eight.hidden == 7).all()
    assert torch.equal(eight.block_tables[:5], torch.cat([want_tables, want_tables[:1]]))
    assert (eight.block_tables[5:] == TRASH_PAGE).all()
    for s in sessions:
        s.close()


def test_adapter_ids_staged_for_the_bucket_only_where_a_row_uses_an_adapter() -> None:
    engine = _engine()
    sessions = [engine.open_session(1, 64) for _ in range(3)]
    for s, index in zip(sessions, (2, 0, 1), strict=True):
        s.adapter_index = index  # (`bind_adapter` needs a span with adapters: the rows' indices are what is staged)
    requests = [StepRequest(s, torch.randn(1, 1, H), 5) for s in sessions]
    staging = HostStaging.allocate(8, H, engine.pool.max_pages_per_seq, torch.float32, pin_memory=False)
    graphs = _Graphs(8, engine.pool.max_pages_per_seq, torch.float32)
    staging.adapter_ids.fill_(9)
    views = staging.row_views(graphs, 3)
    stage_row_inputs(staging, views, merge_rows(requests, torch.float32), False)
    assert (staging.adapter_ids == 9).all()  # no adapter row: nothing staged (nor copied)
    stage_row_inputs(staging, views, merge_rows(requests, torch.float32), True)
    assert views.adapter_ids.tolist() == [2, 0, 1, 0] and (staging.adapter_ids[4:] == 9).all()
    for s in sessions:
        s.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_buckets_input_block_holds_positions_tables_then_hidden_states_aligned(dtype: torch.dtype) -> None:
    layout = InputLayout.of(3, H, 5, dtype)
    parts = [(0, 3 * 8), (layout.tables_offset, 3 * 5 * 4), (layout.hidden_offset, 3 * H * dtype.itemsize)]
    for (start, size), (following, _) in zip(parts, parts[1:], strict=False):
        assert following % 256 == 0 and start + size <= following  # aligned, no overlap, in this order
    assert layout.hidden_end(3) <= layout.nbytes and layout.hidden_end(1) == layout.hidden_offset + H * dtype.itemsize
    block = torch.zeros(layout.nbytes, dtype=torch.uint8)
    positions, tables, hidden = layout.views(block)
    positions.copy_(torch.tensor([1, -2, 3]))
    tables.copy_(torch.arange(15, dtype=torch.int32).view(3, 5))
    hidden.copy_(torch.randn(3, H).to(dtype))
    again = layout.views(block.clone())  # the same bytes read back through a second block's views
    assert again[0].tolist() == [1, -2, 3] and torch.equal(again[1], tables) and torch.equal(again[2], hidden)
    assert InputLayout.of(8, H, 5, dtype).nbytes >= layout.nbytes  # a staging set sized for the largest bucket


def test_the_collected_output_owns_its_rows_and_splits_per_request() -> None:
    class Done:
        waited = 0

        def synchronize(self) -> None:
            self.waited += 1

    staging = HostStaging.allocate(8, H, 4, torch.bfloat16, pin_memory=False)
    staging.out.copy_(torch.randn(8, H).to(torch.bfloat16))
    want = staging.out[:3].clone()
    done = Done()
    pending = PendingDecode(staging, done, 3, [2, 1], H, torch.bfloat16)  # type: ignore[arg-type]
    assert staging.owner is pending and staging.done is done
    staging.reuse()  # a launch from this set first copies this forward's output out
    assert done.waited == 1 and staging.owner is None and staging.done is None
    staging.out.zero_()  # the next forward's output: the collected rows are a copy
    first, second = pending.wait()
    assert first.shape == (2, 1, H) and second.shape == (1, 1, H)
    assert torch.equal(torch.cat([first, second]).view(3, H), want) and done.waited == 1
    with pytest.raises(RuntimeError, match="twice"):
        pending.wait()


class _Done:
    def synchronize(self) -> None:
        pass


def test_an_output_buffer_is_lent_to_the_replies_and_not_written_while_one_views_it() -> None:
    staging = HostStaging.allocate(8, H, 4, torch.bfloat16, pin_memory=False)
    first = staging.output
    staging.out.copy_(torch.randn(8, H).to(torch.bfloat16))
    pending = PendingDecode(staging, _Done(), 3, [2, 1], H, torch.bfloat16)  # type: ignore[arg-type]
    data = pending.output_bytes()
    assert bytes(data) == staging.out[:3].view(torch.uint8).numpy().tobytes()
    staging.out[0].fill_(1.0)  # a view of the buffer, no copy
    assert bytes(data[:2]) == staging.out[0, :1].view(torch.uint8).numpy().tobytes()
    # a reply's tensor of the second request's row: the last view alive (the forward and its bytes dropped)
    reply = TensorBytes(data[2 * H * 2 :], torch.bfloat16, (1, 1, H)).tensor()
    want = reply.clone()
    del pending, data
    staging.reuse()  # the next launch from this set: its output goes elsewhere while the reply views this one
    assert staging.output is not first and staging.spares == [first]
    staging.out.fill_(0.0)
    assert torch.equal(reply, want)
    second = staging.output
    held = PendingDecode(staging, _Done(), 2, [2], H, torch.bfloat16).output_bytes()  # type: ignore[arg-type]
    del reply  # the reply is written: nothing views the first buffer any more
    staging.reuse()  # the second is viewed (`held`): the first is free again, no new buffer
    assert staging.output is first and staging.spares == [second]
    del held
    staging.reuse()
    assert staging.output is first  # nothing views it: reused as it is


def test_a_staging_set_keeps_a_bounded_number_of_spare_outputs() -> None:
    staging = HostStaging.allocate(4, H, 4, torch.float32, pin_memory=False)
    held = []
    for _ in range(MAX_SPARE_OUTPUTS + 3):  # every output still viewed (a caller keeps them all)
        held.append(PendingDecode(staging, _Done(), 1, [1], H, torch.float32).wait())  # type: ignore[arg-type]
        staging.reuse()
    assert len(staging.spares) == MAX_SPARE_OUTPUTS and not staging.output.viewed
    assert len({out[0].data_ptr() for out in held}) == len(held)  # each output in a buffer of its own


@pytest.mark.parametrize("splits,shapes", [([2], None), ([6], {0: (2, 3, H)}), ([2, 6, 1], {1: (3, 2, H)})])
def test_split_rows_views_each_requests_rows_in_its_shape(splits: list[int], shapes: dict | None) -> None:
    # one request (a lone session's step) takes the shortcut without a split call: the same views as the split
    rows = sum(splits)
    out = torch.randn(rows, 1, H)
    pieces = split_rows(out, splits, shapes)
    assert len(pieces) == len(splits)
    start = 0
    for i, (piece, n) in enumerate(zip(pieces, splits, strict=True)):
        want = (shapes or {}).get(i, (n, 1, H))
        assert piece.shape == want and piece.data_ptr() == out[start].data_ptr()  # a view, no copy
        assert torch.equal(piece.reshape(n, 1, H), out[start : start + n])
        start += n


def test_bytes_that_disagree_with_the_hidden_states_are_refused_where_the_step_enters() -> None:
    engine = _engine()
    session = engine.open_session(1, 32)
    hidden = torch.randn(1, 1, H)
    ok = _with_bytes(session, hidden, 0)
    engine.check_inputs(ok)
    assert ok.inputs_checked
    short = StepRequest(session, hidden, 0, hidden_bytes=memoryview(bytearray(4 * H - 4)))
    with pytest.raises(ValueError, match="bytes"):
        engine.check_inputs(short)
    shaped = StepRequest(session, hidden, 0, hidden_bytes=memoryview(bytearray(4 * H)).cast("f"))
    with pytest.raises(ValueError, match="bytes"):
        engine.check_inputs(shaped)
    session.close()


@pytest.mark.parametrize("count", [1, 3])
def test_a_step_batchs_bytes_are_what_its_hidden_states_view(count: int) -> None:
    hiddens = [torch.randn(1, 1, 8).to(torch.bfloat16) for _ in range(count)]
    items = [
        (wire.STEP, 10 + i, wire.Writer().u32(1).u32(2).u8(0).text("").tensor(h).tensor(None).tensor(None))
        for i, h in enumerate(hiddens)
    ]
    payload = memoryview(bytearray(b"".join(batch_payload(items).parts)))
    steps = channel_frames.parse_steps(payload)
    payload[:] = b"\0" * len(payload)  # the receive buffer is reused: the bytes are the step's own copy
    for step, hidden in zip(steps, hiddens, strict=True):
        assert isinstance(step, channel_frames.ParsedStep) and step.hidden is not None and step.raw is not None
        assert step.raw.nbytes == 16 and bytes(step.raw) == hidden.view(torch.uint8).numpy().tobytes()
        step.raw[:2] = b"\0\0"  # the same memory as the tensor
        assert step.hidden.view(-1)[0].item() == 0.0


def _expanded(requests: list[StepRequest]) -> tuple[list[int], list[bytes], list[int], list[int]]:
    """The merged rows as `merge_rows`' docstring states them, one row at a time: positions, tables' bytes, adapter
    ids, rows per request."""
    positions, tables, adapters, splits = [], [], [], []
    for r in requests:
        splits.append(r.rows * r.num_tokens)
        for table in r.session.table_rows:  # row b's block table
            for t in range(r.num_tokens):  # position + t
                positions.append(r.position + t)
                tables.append(bytes(table))
                adapters.append(r.session.adapter_index)
    return positions, tables, adapters, splits


def test_merged_rows_of_one_row_steps_and_wide_requests_are_their_rows_in_order() -> None:
    engine = _engine()
    sessions = [engine.open_session(b, 64) for b in (1, 1, 2, 1, 1, 1)]
    for i, s in enumerate(sessions):
        s.adapter_index = i  # (distinct per session: each row must carry its own)
    tokens = (1, 1, 1, 3, 1, 2)  # a B=2 request, a shadow's 3 positions, a 2-token one last
    requests = [
        _with_bytes(s, torch.randn(s.batch_size, t, H), 4 + i)
        for i, (s, t) in enumerate(zip(sessions, tokens, strict=True))
    ]
    for group in (requests, requests[:2], requests[2:4], requests[3:], requests[:1]):
        merged = merge_rows(group, torch.float32)
        positions, tables, adapters, splits = _expanded(group)
        assert merged.positions == positions and [bytes(t) for t in merged.table_rows] == tables
        assert merged.adapter_ids == adapters and merged.splits == splits and merged.rows == sum(splits)
        several_tokens = {i: r.shape for i, r in enumerate(group) if r.num_tokens > 1}
        assert merged.shapes == (several_tokens or None)
        assert merged.same_dtype and merged.all_cpu and merged.all_bytes
    assert not merge_rows(requests, torch.bfloat16).same_dtype
    mixed = [requests[0], StepRequest(sessions[1], requests[1].hidden.to(torch.bfloat16), 5)]
    merged = merge_rows(mixed, torch.float32)
    assert not merged.same_dtype and not merged.all_bytes and merged.all_cpu
    for s in sessions:
        s.close()
