"""The frame reader shared by the same-host socket and the direct port: a payload arriving in pieces, each within the
idle timeout, is read whole however long it takes in all; a gap longer than the timeout inside a frame (its payload
or its header) ends the stream (`StreamStalled`), one before a frame does not; a declared length over the limit, or one the budget refuses, is refused before any of the
payload is read."""

from __future__ import annotations

import asyncio
import socket

import pytest
from tests.helpers.socket_session import read_frame

from corolla.protocol import local_stream as ls
from corolla.server.core.limits import PeerLimitExceeded, PeerLimits, StreamStalled
from corolla.server.core.peer_bytes import StreamBudget, StreamLease
from corolla.server.front.stream_endpoint import FrameConnection

IDLE_S = 0.5


async def _feed(sock: socket.socket, pieces: list[bytes], gap_s: float) -> None:
    loop = asyncio.get_running_loop()
    for piece in pieces:
        await loop.sock_sendall(sock, piece)
        await asyncio.sleep(gap_s)


def _read(pieces: list[bytes], gap_s: float, *, limit: int = 1 << 20, lease: StreamLease | None = None):
    async def go():
        ours, theirs = socket.socketpair()
        theirs.setblocking(False)
        _, conn = await asyncio.get_running_loop().connect_accepted_socket(FrameConnection, ours)
        feeding = asyncio.create_task(_feed(theirs, pieces, gap_s))
        try:
            return await read_frame(conn, limit, lease=lease, idle_s=IDLE_S)
        finally:
            feeding.cancel()
            conn.close()
            theirs.close()

    return asyncio.run(go())


def test_a_slow_but_steady_payload_is_read_whole() -> None:
    payload = bytes(range(256)) * 40
    frame = b"".join(ls.frame(ls.MESSAGE, payload))
    pieces = [frame[i : i + 2000] for i in range(0, len(frame), 2000)]  # 6 pieces 0.1 s apart: 0.6 s > IDLE_S in all
    assert _read(pieces, gap_s=IDLE_S / 5) == (ls.MESSAGE, payload, 0)


def test_a_gap_inside_a_payload_ends_the_stream() -> None:
    frame = b"".join(ls.frame(ls.MESSAGE, b"x" * 100))
    with pytest.raises(StreamStalled, match="sent nothing"):
        _read([frame[:20], frame[20:]], gap_s=IDLE_S * 3)


def test_a_gap_inside_a_header_ends_the_stream_and_a_gap_between_frames_does_not() -> None:
    # a frame is timed from its first byte (bbc3a44): a header begun counts as a frame begun
    frame = b"".join(ls.frame(ls.MESSAGE, b"x" * 100))
    assert ls.HEADER_BYTES > 2
    with pytest.raises(StreamStalled, match="sent nothing"):
        _read([frame[:2], frame[2:]], gap_s=IDLE_S * 3)
    assert _read([b"", frame], gap_s=IDLE_S * 2) == (ls.MESSAGE, b"x" * 100, 0)  # idle before a frame: no limit


def test_declared_lengths_are_refused_before_the_payload_is_read() -> None:
    with pytest.raises(ValueError, match="exceeds the limit of 64 bytes"):
        _read([ls.header(ls.MESSAGE, 65)], gap_s=10.0, limit=64)  # nothing else ever arrives: refused at once
    lease = StreamLease(StreamBudget(PeerLimits(max_stream_message_bytes=100)), "peer")
    with pytest.raises(PeerLimitExceeded, match="max_stream_message_bytes=100"):
        _read([ls.header(ls.MESSAGE, 500)], gap_s=10.0, lease=lease)
    assert lease.held == 0
