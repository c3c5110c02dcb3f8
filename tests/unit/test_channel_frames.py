"""The handler <-> device channel's frames (`protocol.channel_frames`): tensors of every carried dtype round-trip byte
for byte, a frame over the bound is refused before its payload is read, a tensor record that claims more bytes than
its frame holds is refused before anything is allocated, and a typed refusal crosses as the same type."""

from __future__ import annotations

import asyncio
import struct

import pytest
import torch

from corolla.protocol import channel_frames as wire
from corolla.server.core.limits import PeerLimitExceeded, ServerLimitExceeded
from corolla.server.core.refusals import MESSAGE_REFUSALS, TooLong, decode_error, encode_error
from corolla.utils.errors import AllocationFailed


def _reader(data: bytes) -> asyncio.StreamReader:
    reader = asyncio.StreamReader()
    reader.feed_data(data)
    reader.feed_eof()
    return reader


async def test_tensors_round_trip_byte_for_byte() -> None:
    tensors = [
        torch.randn(2, 3, 4).to(torch.bfloat16), torch.randn(1, 1, 8), torch.randn(3).half(),
        torch.tensor([2, 0, 1]), torch.empty(1, 0, 8), None,
    ]  # fmt: skip
    body = wire.Writer().u32(7).text("adapter")
    for tensor in tensors:
        body.tensor(tensor)
    kind, request_id, payload = await wire.read_frame(_reader(body.frame(wire.STEP, 42)), 1 << 20)
    assert (kind, request_id) == (wire.STEP, 42)
    fields = wire.Reader(payload)
    assert fields.u32() == 7 and fields.text() == "adapter"
    for tensor in tensors:
        got = fields.tensor()
        if tensor is None:
            assert got is None
        else:
            assert got is not None and got.dtype == tensor.dtype and torch.equal(got, tensor)
    fields.done()


async def test_oversized_frames_and_records_are_refused_before_allocation() -> None:
    huge = wire.HEADER.pack(1 << 30, wire.STEP, 1)  # claims 1 GiB; nothing follows
    with pytest.raises(wire.FrameError, match="max_frame_bytes"):
        await wire.read_frame(_reader(huge), 1 << 20)
    with pytest.raises(wire.FrameError, match="unknown frame kind"):
        await wire.read_frame(_reader(wire.HEADER.pack(0, 99, 1)), 1 << 20)
    with pytest.raises(wire.ChannelClosed):
        await wire.read_frame(_reader(wire.HEADER.pack(10, wire.STEP, 1) + b"abc"), 1 << 20)  # cut mid-frame
    lying = struct.pack(">BB3I", 0, 3, 1 << 20, 1 << 20, 4096) + b"\0" * 64  # float32 [2^20, 2^20, 4096] in 64 B
    with pytest.raises(wire.FrameError, match="runs past the payload"):
        wire.Reader(lying).tensor()
    with pytest.raises(wire.FrameError, match="dtype code"):
        wire.Reader(bytes([200, 1, 0, 0, 0, 1])).tensor()


@pytest.mark.parametrize(
    "error",
    [
        TooLong("too long", value=9000, limit=8192),
        PeerLimitExceeded("too many", reason="peer_sessions"),
        AllocationFailed("no cache"),
        TypeError("foreign cache"),
        RuntimeError("anything else"),
        *(refusal(f"refused: {code}") for code, refusal in MESSAGE_REFUSALS.items() if refusal is not TypeError),
        ServerLimitExceeded("server full", reason="server_sessions"),
    ],
)
def test_refusals_cross_as_the_same_type(error: Exception) -> None:
    got = decode_error(wire.Reader(b"".join(encode_error(error).parts)))
    assert type(got) is type(error) and str(got) == str(error)
    if isinstance(error, TooLong):
        assert isinstance(got, TooLong) and (got.value, got.limit) == (9000, 8192)
    if isinstance(error, PeerLimitExceeded):
        assert isinstance(got, PeerLimitExceeded) and got.reason == "peer_sessions"
    if isinstance(error, ServerLimitExceeded):
        assert got.reason == "server_sessions"


async def test_step_batches_round_trip_and_split_within_the_frame_bound() -> None:
    bodies = [wire.Writer().u32(i).tensor(torch.full((1, 1, 8), float(i))) for i in range(5)]
    items = [(wire.STEP, 100 + i, body) for i, body in enumerate(bodies)]
    (only,) = wire.batch_frames(items[:1], wire.STEP_BATCH, 1 << 20)  # one step: a plain STEP frame
    assert (await wire.read_frame(_reader(only), 1 << 20))[:2] == (wire.STEP, 100)
    item_bytes = wire._ITEM.size + bodies[0].nbytes()
    frames = wire.batch_frames(items, wire.STEP_BATCH, max_frame_bytes=2 + 2 * item_bytes)  # two items per frame
    assert len(frames) == 3
    got = []
    for frame in frames:
        kind, _, payload = await wire.read_frame(_reader(frame), 1 << 20)
        if kind == wire.STEP:
            got.append((100 + wire.Reader(payload).u32(), payload))
            continue
        assert kind == wire.STEP_BATCH
        for item_kind, request_id, view in wire.split_batch(wire.Reader(payload), wire.STEP_BATCH):
            assert item_kind == wire.STEP
            got.append((request_id, view))
    assert [r for r, _ in got] == [100, 101, 102, 103, 104]
    for request_id, view in got:
        fields = wire.Reader(view)
        assert fields.u32() == request_id - 100
        tensor = fields.tensor()
        assert tensor is not None and torch.equal(tensor, torch.full((1, 1, 8), float(request_id - 100)))
        fields.done()
    state = wire.Writer().u64(1).u64(2).u64(3)
    (replies,) = wire.batch_frames([(wire.REPLY_TENSORS, 7, bodies[0]), (wire.REPLY_ERROR, 8, bodies[1])],
                                   wire.REPLY_BATCH, 1 << 20, head=state)  # fmt: skip
    kind, _, payload = await wire.read_frame(_reader(replies), 1 << 20)
    fields = wire.Reader(payload)
    assert kind == wire.REPLY_BATCH and (fields.u64(), fields.u64(), fields.u64()) == (1, 2, 3)
    assert [(k, r) for k, r, _ in wire.split_batch(fields, wire.REPLY_BATCH)] == [(wire.REPLY_TENSORS, 7),
                                                                                  (wire.REPLY_ERROR, 8)]  # fmt: skip


@pytest.mark.parametrize(
    "payload, match",
    [
        (struct.pack(">H", 0), "1 to"),  # an empty batch
        (struct.pack(">H", wire.MAX_BATCH_ITEMS + 1), "1 to"),  # more items than allowed
        (struct.pack(">HBII", 1, wire.STEP, 1, 1 << 30) + b"\0" * 16, "runs past the payload"),  # a lying length
        (struct.pack(">HBII", 2, wire.STEP, 1, 0), "runs past the payload"),  # claims 2 items, holds 1
        (struct.pack(">HBII", 1, wire.CALL, 1, 0), "can't be an item"),  # only steps travel in a batch
        (struct.pack(">HBII", 1, wire.STEP, 1, 0) + b"x", "trailing"),
    ],
)
def test_hostile_batches_are_refused_before_anything_is_sliced(payload: bytes, match: str) -> None:
    with pytest.raises(wire.FrameError, match=match):
        wire.split_batch(wire.Reader(payload), wire.STEP_BATCH)


def test_calls_round_trip_their_values_and_types() -> None:
    args = (None, True, False, -(1 << 40), 2.5, "peer", b"\0raw", torch.randn(2, 3), ((0, 4), [b"a" * 16, b"b" * 16]))
    payload = wire.named("forward", args).frame(wire.CALL, 1)[wire.HEADER_BYTES :]
    name, got = wire.read_named(payload)
    assert name == "forward" and got[:7] == args[:7] and got[8] == ((0, 4), (b"a" * 16, b"b" * 16))
    assert torch.equal(got[7], args[7])
    assert wire.matches(got[8], tuple[tuple[int, int], tuple[bytes, ...]])
    assert wire.matches((3, None), tuple[float, float | None])  # an int is a float too
    for value, kind in [
        ((1, 2), tuple[int]), ((True,), tuple[int]), (("1",), tuple[int]), ((1, "x"), tuple[int, ...]), (None, tuple[int])
    ]:  # fmt: skip
        assert not wire.matches(value, kind)
    with pytest.raises(wire.FrameError, match="can't send"):
        wire.Writer().value({"a": 1})


@pytest.mark.parametrize(
    "value, match",
    [
        (bytes([99]), "unknown value tag"),
        (bytes([wire.V_SEQ]) + struct.pack(">H", 3) + bytes([wire.V_NONE]), "runs past the payload"),  # claims 3
        (bytes([wire.V_BLOB]) + struct.pack(">I", 1 << 30), "runs past the payload"),  # a lying length
        ((bytes([wire.V_SEQ]) + struct.pack(">H", 1)) * (wire.MAX_VALUE_DEPTH + 1) + bytes([wire.V_NONE]), "deeper"),
    ],
)
def test_hostile_values_are_refused_before_anything_is_allocated(value: bytes, match: str) -> None:
    payload = wire.Writer().text("call").parts[0] + value
    with pytest.raises(wire.FrameError, match=match):
        wire.read_named(payload)
