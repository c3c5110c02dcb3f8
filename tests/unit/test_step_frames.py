"""The one frame codec's hot paths (`channel_frames.parse_steps`, `reply_frames`) write and read exactly what its
general ones do: reply frames equal `channel_frames.batch_frames` byte for byte (grouping and bounds included), STEP_BATCH items parse to the same
fields and tensors as `channel_frames.Reader`, a malformed item fails alone, and no length a frame claims is trusted
before it is checked."""

from __future__ import annotations

import struct

import pytest
import torch
from tests.helpers.channel_frames import batch_payload

from corolla.protocol import channel_frames as wire
from corolla.server.core.refusals import TooLong, encode_error


def reply_frames(
    results: list[tuple[int, torch.Tensor | BaseException, memoryview | None]], head: bytes, max_frame_bytes: int
) -> list[bytes]:
    return wire.reply_frames(results, head, max_frame_bytes, encode_error)


def _state() -> wire.Writer:
    return wire.Writer().u64(123).u64(4).u64(1 << 40)


def _reference(results: list[tuple[int, torch.Tensor | BaseException]], max_frame_bytes: int) -> list[bytes]:
    items = [
        (wire.REPLY_ERROR, rid, encode_error(r)) if isinstance(r, BaseException)
        else (wire.REPLY_TENSORS, rid, wire.Writer().u8(1).tensor(r))
        for rid, r in results
    ]  # fmt: skip
    return wire.batch_frames(items, wire.REPLY_BATCH, max_frame_bytes, head=_state())


@pytest.mark.parametrize("max_frame_bytes", [1 << 20, 700, 200])
def test_reply_frames_equal_the_reference_encoder(max_frame_bytes: int) -> None:
    torch.manual_seed(0)
    out = torch.randn(7, 16)  # a merged forward's output rows, split into views as the engine returns them
    pieces = out.view(7, 1, 16).split([1, 2, 1, 1, 1, 1])
    results: list[tuple[int, torch.Tensor | BaseException]] = [(i + 1, p) for i, p in enumerate(pieces)]
    results.insert(2, (99, TooLong("too long", value=9, limit=8)))
    results.append((100, torch.randn(1, 1, 16).to(torch.bfloat16)))
    results.append((101, torch.randn(2, 3, 16).transpose(0, 1)))  # not contiguous
    results.append((102, torch.empty(1, 0, 16)))
    results.append((103, torch.randn(1, 1, 5, requires_grad=True)))  # alone in its group, and needing a detach
    head = b"".join(_state().parts)
    assert reply_frames(_no_bytes(results), head, max_frame_bytes) == _reference(results, max_frame_bytes)
    assert reply_frames(_no_bytes(results[:1]), head, max_frame_bytes) == _reference(results[:1], max_frame_bytes)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reply_bytes_of_a_forwards_views_are_read_in_place(dtype: torch.dtype, monkeypatch) -> None:
    torch.manual_seed(1)
    out = torch.randn(6, 16).to(dtype)  # a merged forward's output rows: the engine hands out views of one buffer
    pieces = out.view(6, 1, 16).split(1)
    # runs of adjacent rows (0-1, 3-5), a row out of order (2) and a copy elsewhere
    results: list[tuple[int, torch.Tensor | BaseException]] = [(i + 1, pieces[i]) for i in (0, 1, 3, 4, 5, 2)]
    results.append((9, pieces[0].clone()))
    expected = _reference(results, 1 << 20)

    def no_cat(*args: object, **kwargs: object) -> torch.Tensor:
        raise AssertionError("contiguous step outputs must be encoded without a copy")

    monkeypatch.setattr(torch, "cat", no_cat)
    head = b"".join(_state().parts)
    assert reply_frames(_no_bytes(results), head, 1 << 20) == expected


def test_a_run_of_adjacent_outputs_stops_at_its_storages_end() -> None:
    # two storages side by side in one buffer (as frame copies can be): the second tensor's address follows the
    # first's, but a view of the first storage may not reach into the second
    data = bytearray(torch.randn(3, 16).numpy().tobytes())
    view = memoryview(data)
    first = torch.frombuffer(view[: 2 * 64], dtype=torch.float32).view(2, 1, 16).split(1)  # a storage of 2 rows
    second = torch.frombuffer(view[2 * 64 :], dtype=torch.float32).view(1, 1, 16)  # the next row, its own storage
    assert second.data_ptr() == first[1].data_ptr() + 64
    assert second.untyped_storage().data_ptr() != first[0].untyped_storage().data_ptr()
    results: list[tuple[int, torch.Tensor | BaseException]] = [(1, first[0]), (2, first[1]), (3, second)]
    head = b"".join(_state().parts)
    assert reply_frames(_no_bytes(results), head, 1 << 20) == _reference(results, 1 << 20)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_outputs_with_their_bytes_are_encoded_from_them_without_a_torch_call(dtype: torch.dtype, monkeypatch) -> None:
    torch.manual_seed(2)
    data = bytearray(torch.randn(5, 16).to(dtype).view(torch.uint8).numpy().tobytes())  # a collected output
    out = torch.frombuffer(data, dtype=dtype).view(5, 1, 16)
    pieces = out.split([1, 2, 1, 1])
    raw = memoryview(data)
    row = 16 * dtype.itemsize
    results: list[tuple[int, torch.Tensor | BaseException, memoryview | None]] = [
        (1, pieces[0], raw[:row]),
        (2, pieces[1], raw[row : 3 * row]),
        (3, TooLong("too long", value=9, limit=8), None),
        (4, pieces[3], raw[4 * row : 5 * row]),
        (5, pieces[2], raw[3 * row : 4 * row + 1]),  # bytes of another length: encoded from the tensor
    ]
    expected = _reference([(rid, r) for rid, r, _ in results], 1 << 20)

    def forbidden(self, *args, **kwargs):
        raise AssertionError("an output with its bytes is encoded from them")

    head = b"".join(_state().parts)
    monkeypatch.setattr(torch.Tensor, "untyped_storage", forbidden)
    monkeypatch.setattr(torch.Tensor, "data_ptr", forbidden)
    assert reply_frames(results[:4], head, 1 << 20) == _reference([(rid, r) for rid, r, _ in results[:4]], 1 << 20)
    monkeypatch.undo()
    assert reply_frames(results, head, 1 << 20) == expected
    raw[:row] = bytes(row)  # the bytes sent are the output's memory
    assert reply_frames(results[:1], head, 1 << 20) == _reference([(1, pieces[0])], 1 << 20)


def _no_bytes(
    results: list[tuple[int, torch.Tensor | BaseException]],
) -> list[tuple[int, torch.Tensor | BaseException, memoryview | None]]:
    return [(rid, r, None) for rid, r in results]


def _step_body(handle: int, hidden: torch.Tensor | None, *, prompts=None, hypo_ids=None, adapter="") -> wire.Writer:
    return wire.Writer().u32(handle).u32(5).u8(1).text(adapter).tensor(hidden).tensor(prompts).tensor(hypo_ids)


def _payload(bodies: list[wire.Writer]) -> memoryview:
    frame = batch_payload([(wire.STEP, 10 + i, body) for i, body in enumerate(bodies)]).frame(wire.STEP_BATCH, 0)
    return memoryview(bytearray(frame))[wire.HEADER_BYTES :]


def test_steps_parse_as_the_reference_reader_does() -> None:
    torch.manual_seed(1)
    hiddens = [torch.randn(1, 1, 8), torch.randn(1, 1, 8), torch.randn(2, 4, 8).half(),
               torch.randn(1, 1, 8).to(torch.bfloat16), torch.randn(1, 1, 8)]  # fmt: skip
    bodies = [_step_body(i, h) for i, h in enumerate(hiddens)]
    bodies[1] = _step_body(1, hiddens[1], prompts=torch.randn(2, 1, 3, 8), hypo_ids=torch.tensor([0]), adapter="a")
    payload = _payload(bodies)
    steps = wire.parse_steps(payload)
    payload[:] = b"\0" * len(payload)  # the receive buffer is reused: the steps own copies
    for i, (step, body) in enumerate(zip(steps, bodies, strict=True)):
        assert isinstance(step, wire.ParsedStep)
        fields = wire.Reader(b"".join(body.parts))
        assert (step.request_id, step.handle, step.prefix_length, step.lone) == (10 + i, fields.u32(), fields.u32(),
                                                                                   bool(fields.u8()))  # fmt: skip
        assert step.adapter == fields.text()
        for got, want in ((step.hidden, fields.tensor()), (step.prompts, fields.tensor()),
                          (step.hypo_ids, fields.tensor())):  # fmt: skip
            if want is None:
                assert got is None
            else:
                assert got is not None and got.dtype == want.dtype and torch.equal(got, want)
    lone = wire.parse_step(7, memoryview(bytearray(b"".join(bodies[2].parts))))
    assert lone.hidden is not None and torch.equal(lone.hidden, hiddens[2])


def test_a_malformed_item_fails_alone_and_claimed_lengths_are_checked_first() -> None:
    good = _step_body(1, torch.randn(1, 1, 8))
    huge = wire.Writer().u32(2).u32(0).u8(0).text("")
    huge.parts.append(struct.pack(">BBIII", 0, 3, 1 << 30, 1 << 30, 8))  # claims 2^63 bytes, holds none
    short = wire.Writer().u32(3).u8(0)  # ends inside its fixed fields
    trailing = _step_body(4, torch.randn(1, 1, 8)).u8(0)
    steps = wire.parse_steps(_payload([good, huge, short, trailing]))
    assert isinstance(steps[0], wire.ParsedStep)
    for bad, request_id in zip(steps[1:], (11, 12, 13), strict=True):
        assert isinstance(bad, wire.BadStep) and bad.request_id == request_id
    with pytest.raises(wire.FrameError):  # a batch whose item runs past the frame ends the channel
        wire.parse_steps(_payload([good])[:-3])


def _raw_batch(count: int, items: list[tuple[int, int, bytes]], trailing: bytes = b"") -> memoryview:
    body = struct.pack(">H", count) + b"".join(struct.pack(">BII", k, rid, len(p)) + p for k, rid, p in items)
    return memoryview(bytearray(body + trailing))


@pytest.mark.parametrize(
    "payload",
    [
        _raw_batch(0, []),  # no items
        _raw_batch(wire.MAX_BATCH_ITEMS + 1, []),  # more items than a batch may hold (none follow)
        _raw_batch(2, [(wire.STEP, 1, b"x")]),  # claims two items, holds one
        _raw_batch(1, [(wire.CALL, 1, b"x")]),  # an item kind a step batch can't carry
        _raw_batch(1, [(wire.STEP, 1, b"x")], trailing=b"\0"),  # bytes after the last item
        memoryview(bytearray(struct.pack(">HBII", 1, wire.STEP, 1, 1 << 30))),  # an item claiming 1 GiB
        memoryview(bytearray(b"\1")),  # not even a count
    ],
)
def test_a_malformed_batch_is_refused_as_the_reference_refuses_it(payload: memoryview) -> None:
    with pytest.raises(wire.FrameError):
        wire.split_batch(wire.Reader(payload), wire.STEP_BATCH)
    with pytest.raises(wire.FrameError):
        wire.parse_steps(payload)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_a_lone_step_gets_its_own_copy_without_an_unbind(dtype: torch.dtype, monkeypatch) -> None:
    hidden = torch.randn(2, 1, 8).to(dtype)  # [B, T, H]
    payload = _payload([_step_body(3, hidden)])

    def no_unbind(*args, **kwargs):
        raise AssertionError("a lone step's hidden states are built without an unbind")

    monkeypatch.setattr(torch.Tensor, "unbind", no_unbind)
    (step,) = wire.parse_steps(payload)
    lone = wire.parse_step(9, memoryview(bytearray(b"".join(_step_body(3, hidden).parts))))
    payload[:] = b"\0" * len(payload)  # the receive buffer is reused: the step owns its copy
    for got in (step, lone):
        assert isinstance(got, wire.ParsedStep) and got.hidden is not None
        assert got.hidden.shape == hidden.shape and got.hidden.dtype == dtype and torch.equal(got.hidden, hidden)
        got.hidden.add_(1)  # writable, and its own memory
    assert not torch.equal(step.hidden, hidden) and torch.equal(lone.hidden, step.hidden)


@pytest.mark.parametrize("count", [1, 3])
def test_parsed_steps_carry_bytes_and_build_no_tensor_until_asked(count: int, monkeypatch) -> None:
    hiddens = [torch.randn(1, 1, 8).to(torch.bfloat16) for _ in range(count)]  # [B, T, H] each
    payload = _payload([_step_body(3, h) for h in hiddens])

    def no_torch(*args, **kwargs):
        raise AssertionError("the reader thread parses a frame without a torch call")

    with monkeypatch.context() as patched:
        patched.setattr(wire.torch, "frombuffer", no_torch)
        patched.setattr(torch.Tensor, "view", no_torch)
        steps = wire.parse_steps(payload)
    payload[:] = b"\0" * len(payload)  # the receive buffer is reused: the steps own their copy
    for step, hidden in zip(steps, hiddens, strict=True):
        assert isinstance(step, wire.ParsedStep) and step.raw is not None
        assert step.dtype == torch.bfloat16 and step.shape == (1, 1, 8)
        assert bytes(step.raw) == hidden.view(torch.uint8).numpy().tobytes()
        assert step.hidden is not None and torch.equal(step.hidden, hidden) and step.hidden is step.hidden


@pytest.mark.parametrize("max_frame_bytes", [1 << 20, 400, 260, 100])
@pytest.mark.parametrize("with_bytes", [False, True])
def test_one_shape_replies_equal_the_reference_at_every_frame_bound(max_frame_bytes: int, with_bytes: bool) -> None:
    # a frame task's usual outputs (one dtype and shape, all CPU tensors): the same bytes
    # as the reference, split where it splits (a last frame of one item included), bytes known or read in place
    torch.manual_seed(3)
    out = torch.randn(7, 16)
    pieces = out.view(7, 1, 16).split(1)
    raw = memoryview(out.numpy()).cast("B")
    row = 16 * 4
    results = [(i + 1, pieces[i], raw[i * row : (i + 1) * row] if with_bytes else None) for i in range(7)]
    results[3] = (4, pieces[3].clone(), None)  # elsewhere: read from its tensor
    expected = _reference([(rid, r) for rid, r, _ in results], max_frame_bytes)
    head = b"".join(_state().parts)
    assert reply_frames(results, head, max_frame_bytes) == expected
    for n in (1, 2, 5):
        assert reply_frames(results[:n], head, max_frame_bytes) == _reference(
            [(rid, r) for rid, r, _ in results[:n]], max_frame_bytes
        )


def test_a_list_of_mixed_shapes_dtypes_or_refusals_is_encoded_as_the_reference() -> None:
    torch.manual_seed(4)
    base = [(1, torch.randn(1, 1, 16)), (2, torch.randn(1, 1, 16))]
    tails: list[tuple[int, torch.Tensor | BaseException]] = [
        (3, torch.randn(1, 1, 8)),
        (3, torch.randn(1, 1, 16).half()),
        (3, TooLong("too long", value=9, limit=8)),
        (3, torch.empty(1, 0, 16)),
    ]
    head = b"".join(_state().parts)
    for tail in tails:
        results = [*base, tail]
        assert reply_frames(_no_bytes(results), head, 1 << 20) == _reference(results, 1 << 20)
        assert reply_frames(_no_bytes([tail, *base]), head, 1 << 20) == _reference([tail, *base], 1 << 20)


def test_a_frames_hidden_states_become_tensors_in_one_view_per_group(monkeypatch) -> None:
    # steps of one dtype and shape share one copy; where the engine needs their tensors (the eager/CPU path), the
    # first request's `hidden` views the whole copy once and every request gets its row of it, viewing its bytes
    from corolla.engine import step_request
    from corolla.engine.step_request import StepRequest
    from corolla.utils import tensor_bytes

    torch.manual_seed(5)
    hiddens = [torch.randn(1, 1, 8) for _ in range(3)] + [torch.randn(2, 1, 8)]
    steps = wire.parse_steps(_payload([_step_body(i, h) for i, h in enumerate(hiddens)]))
    assert all(isinstance(step, wire.ParsedStep) for step in steps)
    parsed = [step for step in steps if isinstance(step, wire.ParsedStep)]
    assert [step.rows[1] if step.rows is not None else None for step in parsed] == [0, 1, 2, None]  # alone: none
    views: list[tuple[int, ...]] = []
    view_bytes = step_request.view_bytes

    def counted(raw: memoryview, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        views.append(shape)
        return view_bytes(raw, dtype, shape)

    monkeypatch.setattr(step_request, "view_bytes", counted)
    monkeypatch.setattr(tensor_bytes, "view_bytes", counted)  # (`HiddenRows.row`'s)
    requests = [StepRequest(None, None, 3, None, None, s.raw, s.dtype, s.shape, s.rows) for s in parsed]  # type: ignore[arg-type]
    for request, want in zip(requests, hiddens, strict=True):
        assert torch.equal(request.hidden, want) and request.hidden is request.hidden
    assert views == [(3, 1, 1, 8), (2, 1, 8)]  # one view for the group of three, one for the lone step
    raw = parsed[1].raw
    assert raw is not None
    raw[:4] = struct.pack("<f", 42.0)  # the row is the step's bytes, not a copy of them
    assert requests[1].hidden[0, 0, 0].item() == 42.0
