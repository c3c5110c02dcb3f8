"""`stream_guard.guarded_stream_handler`'s answers on a p2p forward or backward stream: a method's refusal is sent
after the caller's end-of-stream was read (closing a unix socket with unread bytes resets it, and p2pd may then drop
the refusal it has not delivered), a caller that never ends its input is not waited for long, and a method failing
on a cancelled wait answers an error instead of closing silently."""

from __future__ import annotations

import asyncio
import socket
import time

from hivemind.p2p import P2P, PeerID
from hivemind.proto import runtime_pb2

from corolla.server.core.limits import PeerLimits
from corolla.server.core.peer_bytes import StreamBudget
from corolla.server.front import stream_guard

CLIENT_PEER = PeerID(b"test-client")  # a peer id object, as p2pd reports a stream's peer
PART_BODY = runtime_pb2.ExpertRequest(uid="p.0").SerializeToString()
PART = P2P.MESSAGE_MARKER + len(PART_BODY).to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER) + PART_BODY
END = P2P.ERROR_MARKER + (0).to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER)


async def _serve(method, name: str, sent: bytes, end_delay_s: float | None) -> tuple[bytes, float, bool]:
    """Serves one stream of `method` whose caller sends `sent`, then its end-of-stream `end_delay_s` later (None:
    with it); returns what the caller received, how long the handler took, and whether the caller's end had been
    sent when the handler returned."""
    loop = asyncio.get_running_loop()
    ours, theirs = socket.socketpair()
    theirs.setblocking(False)
    reader, writer = await asyncio.open_unix_connection(sock=ours)
    handle = stream_guard.guarded_stream_handler(
        type("P2PStub", (), {"peer_id": "server"})(),
        name,
        method,
        StreamBudget(PeerLimits()),
        on_reject=lambda *_: None,
    )
    await loop.sock_sendall(theirs, sent if end_delay_s is not None else sent + END)
    end_sent = end_delay_s is None

    async def send_end() -> None:
        nonlocal end_sent
        await asyncio.sleep(end_delay_s or 0)
        await loop.sock_sendall(theirs, END)
        end_sent = True

    ending = asyncio.create_task(send_end()) if end_delay_s is not None else None
    started = time.monotonic()
    await asyncio.wait_for(handle(type("StreamInfo", (), {"peer_id": CLIENT_PEER})(), reader, writer), 5.0)
    elapsed_s, ended_first = time.monotonic() - started, end_sent
    if ending is not None:
        ending.cancel()
    received = b""
    while chunk := await asyncio.wait_for(loop.sock_recv(theirs, 1 << 16), 5.0):
        received += chunk
    theirs.close()
    return received, elapsed_s, ended_first


async def _refuse_second(requests, context):
    count = 0
    async for _ in requests:
        count += 1
        if count == 2:
            raise ValueError("every part must name the same uid")
    yield runtime_pb2.ExpertResponse()


def test_a_refused_stream_reads_the_callers_end_before_it_closes():
    """The handler refuses the second part while the caller's end-of-stream is still on its way: it reads that end
    before it closes."""
    received, _, ended_first = asyncio.run(_serve(_refuse_second, "rpc_forward_stream", PART + PART, 0.05))
    assert received.startswith(P2P.ERROR_MARKER) and b"same uid" in received
    assert ended_first  # the end arrived and was read before closing


def test_a_caller_that_never_ends_its_input_is_not_waited_for_long():
    received, elapsed_s, _ = asyncio.run(_serve(_refuse_second, "rpc_forward_stream", PART + PART, 30.0))
    assert b"same uid" in received
    assert elapsed_s < stream_guard.FINISH_INPUT_S + 1.0


def test_a_method_failing_on_a_cancelled_wait_answers_an_error_instead_of_closing_silently():
    """A cancellation out of something the method awaited (not of the stream's own task) is a failure like any
    other: the caller gets an error reply. It used to end the stream with no reply at all (the caller read an empty
    answer) and no log."""

    async def fails_on_cancelled_future(requests, context):
        async for _ in requests:
            pass
        future = asyncio.get_running_loop().create_future()
        asyncio.get_running_loop().call_soon(future.cancel)
        await future  # CancelledError: the future was cancelled elsewhere, this task was not
        yield runtime_pb2.ExpertResponse()

    received, _, _ = asyncio.run(_serve(fails_on_cancelled_future, "rpc_backward_stream", PART, None))
    assert received.startswith(P2P.ERROR_MARKER) and b"cancelled" in received
