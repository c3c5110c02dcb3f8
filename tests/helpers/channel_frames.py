"""A device channel for tests: one served over a socket pair (`served_channel`; several sharing one core and one
intake as a handler pool's do: `served_channels`), blocking reads of its frames (the
server reads them from its intake thread), a batch payload built item by item (`batch_payload`), and a session opened
through a handler process's seam to the core with the caps off."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
from collections.abc import AsyncIterator, Sequence

from corolla.engine import EngineConfig, SpanEngine
from corolla.protocol import channel_frames as wire
from corolla.server.backend import SpanBackend
from corolla.server.core.engine_executor import EngineExecutor
from corolla.server.core.executor import SessionCache, SessionOpen, SessionSpec
from corolla.server.core.limits import PeerLimits
from corolla.server.core.runtime import Runtime
from corolla.server.core.span_core import SpanCore
from corolla.server.handlers.device_channel import ChannelIntake, DeviceChannel, FrameSocket
from corolla.server.handlers.remote_core import DeviceLink, RemoteCore

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
    async with core.open_session(SessionOpen("peer-a", spec, alloc_timeout_s)) as (_, cache):
        assert cache is not None
        yield cache


@contextlib.asynccontextmanager
async def served_channel(
    backend: SpanBackend, span: Sequence[int]
) -> AsyncIterator[tuple[EngineExecutor, DeviceChannel, asyncio.Task[None], DeviceLink]]:
    """A CPU engine executor of `span` of `backend` (1 MiB of pages of 16 tokens, 8 rows) served by a `DeviceChannel`
    (caps off) over a socket pair, and the handler end's `DeviceLink`; yields (executor, channel, its serving task,
    link). On exit the link closes and the channel's serving ends."""
    with Runtime(max_batch_size_tokens=1024) as runtime:
        config = EngineConfig(kv_pool_bytes=1 << 20, page_size_tokens=16, max_seq_len_tokens=64, max_batch_rows=8)
        real = EngineExecutor(backend, SpanEngine.from_blocks([backend.blocks[i] for i in span], config), runtime)
        device_end, handler_end = socket.socketpair()
        channel = DeviceChannel(0, device_end, core=SpanCore(real, NO_CAPS), span=tuple(span), max_frame_bytes=1 << 20)
        serving = asyncio.create_task(channel.serve())
        link = await DeviceLink.connect(*await asyncio.open_unix_connection(sock=handler_end))
        try:
            yield real, channel, serving, link
        finally:
            await link.close()
            await asyncio.wait_for(serving, 10)


@contextlib.asynccontextmanager
async def served_channels(
    backend: SpanBackend, span: Sequence[int], count: int
) -> AsyncIterator[tuple[EngineExecutor, list[DeviceChannel], list[asyncio.Task[None]], list[DeviceLink]]]:
    """`count` channels as `served_channel`'s, over one executor and one `SpanCore`, read by one `ChannelIntake` (a
    handler pool's layout); yields (executor, channels, their serving tasks, their handler ends' links)."""
    with Runtime(max_batch_size_tokens=1024) as runtime, ChannelIntake() as intake:
        config = EngineConfig(kv_pool_bytes=1 << 20, page_size_tokens=16, max_seq_len_tokens=64, max_batch_rows=8)
        real = EngineExecutor(backend, SpanEngine.from_blocks([backend.blocks[i] for i in span], config), runtime)
        core = SpanCore(real, NO_CAPS)
        channels, servings, links = [], [], []
        try:
            for index in range(count):
                device_end, handler_end = socket.socketpair()
                channel = DeviceChannel(
                    index, device_end, core=core, span=tuple(span), max_frame_bytes=1 << 20,
                    intake=intake,
                )  # fmt: skip
                channels.append(channel)
                servings.append(asyncio.create_task(channel.serve()))
                links.append(await DeviceLink.connect(*await asyncio.open_unix_connection(sock=handler_end)))
            yield real, channels, servings, links
        finally:
            for link in links:
                await link.close()
            for channel in channels:
                channel.close()
            await asyncio.wait_for(asyncio.gather(*servings, return_exceptions=True), 10)
