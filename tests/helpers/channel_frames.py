"""Blocking reads of a device channel's frames for tests (the server reads them from its intake thread)."""

from __future__ import annotations

from corolla.server.handlers.channel_io import FrameSocket


def recv_frame(io: FrameSocket) -> tuple[int, int, memoryview]:
    """The next frame, waiting for it (blocking `receive`s until `next_frame` has one)."""
    while (frame := io.next_frame()) is None:
        io.receive(block=True)
    return frame
