"""A device channel for tests: blocking reads of its frames (the server reads them from its intake thread), a batch
payload built item by item (`batch_payload`), and a session opened through a handler process's seam to the core with
the caps off."""

from __future__ import annotations

import contextlib
import struct
from collections.abc import AsyncIterator

from corolla.protocol import channel_frames as wire
from corolla.server.core.executor import SessionCache, SessionSpec
from corolla.server.core.limits import PeerLimits
from corolla.server.handlers.device_channel import FrameSocket
from corolla.server.handlers.remote_core import RemoteCore

# a core whose admission caps nothing (0 disables a cap): tests of the work, not of fair use
NO_CAPS = PeerLimits(
    max_sessions_per_peer=0, max_sessions_total=0, max_kv_fraction_per_peer=1.0, max_forwards_per_peer=0
)


def batch_payload(items: list[tuple[int, int, wire.Writer]]) -> wire.Writer:
    """A batch payload (`protocol.channel_frames`: a u16 count, then per item its kind, request id and length and its
    body) of (kind, request id, body) items, as `batch_frames` writes one."""
    out = wire.Writer()
    out.parts.append(struct.pack(">H", len(items)))
    for kind, request_id, body in items:
        out.parts.append(struct.pack(">BII", kind, request_id, body.nbytes()))
        out.parts.extend(body.parts)
    return out


def recv_frame(io: FrameSocket) -> tuple[int, int, memoryview]:
    """The next frame, waiting for it (blocking `receive`s until `next_frame` has one)."""
    while (frame := io.next_frame()) is None:
        io.receive(block=True)
    return frame


@contextlib.asynccontextmanager
async def remote_session(
    core: RemoteCore, spec: SessionSpec, alloc_timeout_s: float = 0
) -> AsyncIterator[SessionCache]:
    """A session of one peer opened through `core`; yields its cache."""
    async with core.open_session("peer-a", spec, alloc_timeout_s, None, None) as (_, cache):
        assert cache is not None
        yield cache
