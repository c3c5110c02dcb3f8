"""One `rpc_inference` stream against a handler in this process, served as the same-host socket serves an accepted
connection (`stream_endpoint.serve_inference`: the handler's `serve_steps` through the socket's port, the local
stream's frames) over a socket pair: the production path of a stream without p2pd, for tests of the handler."""

from __future__ import annotations

import asyncio
import socket

from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import runtime_pb2

from corolla.protocol import local_stream as ls
from corolla.server.core.limits import MessagePace
from corolla.server.core.peer_bytes import StreamLease
from corolla.server.front.stream_endpoint import FrameConnection, PlainFrames, StreamRpcs, serve_inference

SERVER_PEER = PeerID(b"\x12\x20" + bytes(32))  # the context's local id (nothing reads it)


async def socket_session(
    handler: StreamRpcs, requests: list[runtime_pb2.ExpertRequest], *, peer: PeerID | None = None
) -> tuple[list[bytes], str | None]:
    """Sends `requests` and the stream's end, serves the stream to its end as `peer` (None: the same-host socket's
    client); the payloads of the replies and the stream's error text (None: it ended cleanly)."""
    loop = asyncio.get_running_loop()
    ours, theirs = socket.socketpair()
    _, conn = await loop.connect_accepted_socket(FrameConnection, ours)
    reader, writer = await asyncio.open_unix_connection(sock=theirs)
    for request in requests:
        writer.writelines(ls.frame(ls.MESSAGE, request.SerializeToString()))
    writer.writelines(ls.frame(ls.END))
    writer.write_eof()
    reading = asyncio.ensure_future(_replies(reader))
    context = P2PContext(handle_name="rpc_inference", local_id=SERVER_PEER, remote_id=peer)
    try:
        await serve_inference(handler, conn, context, PlainFrames(), handler.max_stream_bytes + (1 << 20))
        return await reading
    finally:
        conn.close()
        writer.close()
        reading.cancel()


async def _replies(reader: asyncio.StreamReader) -> tuple[list[bytes], str | None]:
    """The MESSAGE payloads up to the stream's last frame (END, or ERROR with its text)."""
    payloads: list[bytes] = []
    while True:
        kind, payload = await ls.read_frame(reader, 1 << 30)
        if kind == ls.MESSAGE:
            payloads.append(payload)
        elif kind == ls.END:
            return payloads, None
        else:
            assert kind == ls.ERROR, kind
            return payloads, payload.decode()


async def read_frame(
    conn: FrameConnection,
    max_payload_bytes: int,
    *,
    lease: StreamLease | None = None,
    idle_s: float | None = None,
    pace: MessagePace | None = None,
) -> tuple[int, bytes, int]:
    """(kind, payload, bytes charged to `lease`) of the connection's next frame, read as a socket front reads one:
    its payload charged to `lease` once its header is parsed, before it is waited for."""
    held = 0 if lease is None else lease.held
    charge = None if lease is None else lease.charge
    kind, payload = await conn.read_frame(max_payload_bytes, charge=charge, idle_s=idle_s, pace=pace)
    return kind, payload, (0 if lease is None else lease.held - held)
