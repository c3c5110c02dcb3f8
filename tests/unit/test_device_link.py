"""A handler process's link to the device process (`remote_core.DeviceLink.open`): a frame far larger than
asyncio's default reader limit (a merged forward's replies for many sessions) is read without pausing and resuming
the socket's reading, and arrives whole."""

from __future__ import annotations

import asyncio
import socket
import threading

from hivemind.proto import runtime_pb2

from corolla.protocol import channel_frames as wire
from corolla.protocol.channel_frames import DeviceInfo
from corolla.server.handlers.remote_core import DeviceLink


async def test_a_large_frame_is_read_without_pausing_the_socket() -> None:
    ours, theirs = socket.socketpair()
    info = DeviceInfo("fused", 8 << 20, {0: 1})
    state = wire.Writer().u64(1).u64(1).f64(None)
    big = runtime_pb2.ExpertRequest(uid="x", tensors=[runtime_pb2.Tensor(buffer=b"\1" * (3 << 20))])
    push = wire.named("push", ("session", None, big.SerializeToString()))
    hello = wire.Writer()
    hello.parts.append(info.to_json())
    theirs.sendall(hello.frame(wire.HELLO, 0) + state.frame(wire.STATE, 0))
    link = await DeviceLink.open(ours)
    pauses: list[int] = []
    transport = link.writer.transport
    original = transport.pause_reading

    def counted() -> None:
        pauses.append(1)
        original()

    transport.pause_reading = counted  # type: ignore[method-assign]
    got = asyncio.get_running_loop().create_future()
    link.notes["push"] = (tuple[str, str | None, bytes], lambda session_id, sender, raw: got.set_result(raw))
    sender = threading.Thread(target=theirs.sendall, args=(push.frame(wire.NOTE, 0),))
    sender.start()
    request = runtime_pb2.ExpertRequest.FromString(await asyncio.wait_for(got, 10))
    sender.join(5)
    assert len(request.tensors[0].buffer) == 3 << 20  # whole
    assert pauses == []  # asyncio's default limit (64 KiB) pauses reading past 128 KiB
    await link.close()
    theirs.close()
