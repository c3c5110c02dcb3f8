"""The host side of a launched merged forward (`engine.graph_decode`), on the CPU with plain buffers standing in for
the pinned ones and the graphs' static inputs: rows staged from their bytes (`StepRequest.hidden_bytes`, a device
channel's frame copy) and block tables with memoryview copies equal what `torch.cat`/`torch.stack` give, the
bucket's rows past the live ones point at the trash page, slices are made once per row count, the collected output
owns its memory; a step's bytes that disagree with its hidden states are refused where the step enters; a STEP_BATCH
step's bytes are the memory its hidden states view."""

from __future__ import annotations

import pytest
import torch
from tests.helpers.channel_frames import batch_payload

from corolla.engine import EngineConfig, SpanEngine
from corolla.engine.graph_decode import (
    HostStaging,
    PendingDecode,
    merge_rows,
    stage_hidden_bytes,
    stage_row_inputs,
)
from corolla.engine.kv.kv_pool import TRASH_PAGE
from corolla.engine.span_engine import StepRequest
from corolla.models.registry import get_family
from corolla.protocol import channel_frames
from corolla.protocol import channel_frames as wire
from helpers.tiny_models import tiny_config

H = 64  # tiny_config hidden size


class _Graphs:
    """The static inputs of `DecodeGraphs` (CPU tensors) and its bucket rule, nothing else."""

    def __init__(self, max_rows: int, pages: int, dtype: torch.dtype):
        self.buckets = (1, 2, 4, max_rows)
        self.hidden = torch.full((max_rows, H), 7.0, dtype=dtype)
        self.positions = torch.full((max_rows,), 99, dtype=torch.long)
        self.block_tables = torch.full((max_rows, pages), 55, dtype=torch.int32)

    def bucket_for(self, rows: int) -> int:
        return next(b for b in self.buckets if b >= rows)


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
    staging.tables_np[:] = 123  # an earlier forward's rows: the padding must not keep them

    def forbidden(*args, **kwargs):
        raise AssertionError("rows are staged without torch.cat / torch.stack")

    monkeypatch.setattr(torch, "cat", forbidden)
    monkeypatch.setattr(torch, "stack", forbidden)
    merged = merge_rows(requests, dtype)
    assert merged.all_bytes and merged.same_dtype and merged.rows == 4 and merged.splits == [1, 2, 1]
    part = requests[1:]  # 3 live rows in a bucket of 4
    views = staging.row_views(graphs, 3)
    stage_hidden_bytes(staging.hidden_bytes, part)
    stage_row_inputs(staging, views, merge_rows(part, dtype), None)
    monkeypatch.undo()
    assert views.bucket == 4 and torch.equal(staging.hidden[:3], want_hidden[1:])
    assert graphs.positions[:4].tolist() == [4, 4, 5, 0] and graphs.positions[4:].tolist() == [99] * 4
    assert torch.equal(graphs.block_tables[:3], want_tables[1:])
    assert (graphs.block_tables[3] == TRASH_PAGE).all() and (graphs.block_tables[4:] == 55).all()
    assert staging.row_views(graphs, 3) is views  # made once per row count
    views = staging.row_views(graphs, 4)
    stage_hidden_bytes(staging.hidden_bytes, requests)
    views.graph_hidden.copy_(views.hidden)
    stage_row_inputs(staging, views, merged, None)
    assert torch.equal(graphs.hidden[:4], want_hidden) and (graphs.hidden[4:] == 7).all()
    assert torch.equal(graphs.block_tables[:4], want_tables) and graphs.positions[:4].tolist() == [3, 4, 4, 5]
    assert torch.equal(merged.tables(), want_tables)  # the eager path's tables
    for s in sessions:
        s.close()


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
