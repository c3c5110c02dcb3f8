"""The device side's frame reader (`server.handlers.device_channel.FrameSocket`) reads frames that arrive together out of
one buffer and frames cut anywhere across reads, grows its buffer only to the largest frame, refuses a frame over the
bound from its header alone, and ends with ChannelClosed when the other end goes."""

from __future__ import annotations

import socket
import threading

import pytest

from corolla.protocol import channel_frames as wire
from corolla.server.handlers.device_channel import INITIAL_BUFFER_BYTES, FrameSocket
from helpers.channel_frames import recv_frame


def _frames() -> list[tuple[int, int, bytes]]:
    sizes = [0, 1, 7, 300, INITIAL_BUFFER_BYTES - 5, 3 * INITIAL_BUFFER_BYTES, 2, 40]
    return [(wire.STEP if i % 2 else wire.NOTE, i + 1, bytes([i]) * n) for i, n in enumerate(sizes)]


@pytest.mark.parametrize("chunk", [1, 5, 4096, 1 << 20])
def test_frames_cut_anywhere_or_sent_together_arrive_whole(chunk: int) -> None:
    frames = _frames()
    data = b"".join(wire.HEADER.pack(len(p), kind, rid) + p for kind, rid, p in frames)
    device_end, handler_end = socket.socketpair()

    def send() -> None:
        for i in range(0, len(data), chunk):
            handler_end.sendall(data[i : i + chunk])
        handler_end.close()

    sender = threading.Thread(target=send)
    sender.start()
    with FrameSocket(device_end, max_frame_bytes=4 * INITIAL_BUFFER_BYTES) as io:
        for kind, rid, payload in frames:
            got = recv_frame(io)
            assert (got[0], got[1], bytes(got[2])) == (kind, rid, payload)
        with pytest.raises(wire.ChannelClosed):
            recv_frame(io)
        assert len(io._buffer) <= 3 * INITIAL_BUFFER_BYTES + wire.HEADER_BYTES  # the largest frame, not the stream
    sender.join(5)


def test_a_frame_over_the_bound_is_refused_from_its_header() -> None:
    device_end, handler_end = socket.socketpair()
    handler_end.sendall(wire.HEADER.pack(1 << 30, wire.STEP, 1))  # claims 1 GiB, sends nothing more
    with FrameSocket(device_end, max_frame_bytes=1 << 20) as io:
        with pytest.raises(wire.FrameError, match="max_frame_bytes"):
            recv_frame(io)
        assert len(io._buffer) <= INITIAL_BUFFER_BYTES
    handler_end.close()
