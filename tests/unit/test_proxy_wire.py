"""The handler <-> device channel's frames (`server.proxy_wire`): tensors of every carried dtype round-trip byte
for byte, a frame over the bound is refused before its payload is read, a tensor record that claims more bytes than
its frame holds is refused before anything is allocated, and a typed refusal crosses as the same type."""

from __future__ import annotations

import asyncio
import struct

import pytest
import torch

from corolla.server import proxy_wire as wire
from corolla.server.limits import PeerLimitExceeded
from corolla.server.refusals import TooLong
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
    ],
)
def test_refusals_cross_as_the_same_type(error: Exception) -> None:
    got = wire.decode_error(wire.Reader(b"".join(wire.encode_error(error).parts)))
    assert type(got) is type(error) and str(got) == str(error)
    if isinstance(error, TooLong):
        assert isinstance(got, TooLong) and (got.value, got.limit) == (9000, 8192)
    if isinstance(error, PeerLimitExceeded):
        assert isinstance(got, PeerLimitExceeded) and got.reason == "peer_sessions"
