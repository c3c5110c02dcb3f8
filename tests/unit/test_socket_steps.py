"""A socket stream's steps without a task per step (`stream_endpoint.SocketPort` handing requests to a
`inference_stream.StepOrder` from the connection's data callback): every request is handed over once and in order, also
thousands that arrive in one read and are each over at once (handed over in a loop, not recursively: no
RecursionError); a request arriving in pieces is handed over when whole; a payload that stops arriving ends the
session with `StreamStalled`; the end of the client's input ends the session quietly."""

from __future__ import annotations

import asyncio
import socket
import time

import pytest
from hivemind.proto import runtime_pb2
from hivemind.utils.serializer import MSGPackSerializer

from corolla.protocol import local_stream as ls
from corolla.server.core.executor import SessionSpec
from corolla.server.core.limits import SessionTimeouts, StreamStalled
from corolla.server.front.inference_stream import SessionState, StepOrder
from corolla.server.front.stream_endpoint import FrameConnection, PlainFrames, SocketPort

BOUND_S = 10.0


def _frame(step_id: str) -> bytes:
    tensor = runtime_pb2.Tensor(buffer=b"x", size=[1], dtype="float32")
    request = runtime_pb2.ExpertRequest(
        uid="p.0", tensors=[tensor], metadata=MSGPackSerializer.dumps({"step_id": step_id})
    )
    return b"".join(ls.frame(ls.MESSAGE, request.SerializeToString()))


async def _serve(send, *, idle_s: float | None = None, reply_bytes: int = 0) -> tuple[list[str], BaseException | None]:
    """The step ids a session ran, each over at once (answered with `reply_bytes` where > 0), of what `send(sock)`
    sends, and the error it ended with."""
    ours, theirs = socket.socketpair()
    theirs.setblocking(False)
    loop = asyncio.get_running_loop()
    _, conn = await loop.connect_accepted_socket(FrameConnection, ours)
    port = SocketPort(conn, PlainFrames(), 1 << 20, lease=None, idle_s=idle_s, timeline=None)
    session = SessionState("s", SessionSpec((0,), 1, 8), None, "", None)
    timeouts = SessionTimeouts(step_timeout_s=BOUND_S, session_timeout_s=BOUND_S, request_timeout_s=BOUND_S)
    seen: list[str] = []
    ended: asyncio.Future = loop.create_future()

    def run(_request: runtime_pb2.ExpertRequest, metadata) -> bool:
        seen.append(metadata.step_id)
        if reply_bytes:
            port.reply(runtime_pb2.ExpertResponse(tensors=[runtime_pb2.Tensor(buffer=bytes(reply_bytes))]))
        return True

    order = StepOrder(session, timeouts, time.monotonic() + BOUND_S, None, run=run, ready=port.ready,
                      end=lambda error: ended.done() or ended.set_result(error))  # fmt: skip
    requests = port.requests()
    port.attach(order, requests)
    sending = asyncio.create_task(send(theirs))
    try:
        order.client(await requests.__anext__())
        error = await asyncio.wait_for(ended, BOUND_S)
    finally:
        sending.cancel()
        port.detach()
        conn.close()
        theirs.close()
    return seen, error


async def test_thousands_of_buffered_requests_are_handed_over_in_order_without_recursion() -> None:
    count = 3000

    async def send(sock: socket.socket) -> None:
        await asyncio.get_running_loop().sock_sendall(sock, b"".join(_frame(f"s{i}") for i in range(count)))
        sock.shutdown(socket.SHUT_WR)

    seen, error = await _serve(send)
    assert error is None and seen == [f"s{i}" for i in range(count)]


async def test_a_request_in_pieces_is_handed_over_whole_and_a_stalled_payload_ends_the_session() -> None:
    whole, cut = _frame("s0") + _frame("s1"), _frame("s2")

    async def send(sock: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        for i in range(0, len(whole), 7):  # the first two requests trickle in, 7 bytes at a time
            await loop.sock_sendall(sock, whole[i : i + 7])
            await asyncio.sleep(0.005)
        await loop.sock_sendall(sock, cut[:-3])  # then the third stops 3 bytes short
        await asyncio.sleep(3600)

    seen, error = await _serve(send, idle_s=1.0)  # (gaps of 5 ms: only a loop stalled for 1 s could fail it)
    assert seen == ["s0", "s1"]
    assert isinstance(error, StreamStalled)


async def test_the_end_of_the_input_ends_the_session_quietly() -> None:
    async def send(sock: socket.socket) -> None:
        await asyncio.get_running_loop().sock_sendall(sock, _frame("s0") + _frame("s1"))
        await asyncio.sleep(0.05)
        sock.shutdown(socket.SHUT_WR)

    seen, error = await _serve(send)
    assert error is None and seen == ["s0", "s1"]


async def test_a_client_that_stops_reading_and_leaves_ends_its_session_at_once() -> None:
    """Its replies fill the socket (the next request waits until they are taken); its close ends the session, not
    the step timeout."""

    async def send(sock: socket.socket) -> None:
        await asyncio.get_running_loop().sock_sendall(sock, b"".join(_frame(f"s{i}") for i in range(8)))
        await asyncio.sleep(0.3)  # the replies pile up unread
        sock.close()

    started = time.monotonic()
    seen, error = await _serve(send, reply_bytes=4 << 20)
    assert error is None and 1 <= len(seen) < 8
    assert time.monotonic() - started < BOUND_S / 2


@pytest.mark.parametrize("kind", [ls.HELLO, ls.ACCEPT])
async def test_a_frame_of_another_kind_ends_the_session_with_an_error(kind: int) -> None:
    async def send(sock: socket.socket) -> None:
        await asyncio.get_running_loop().sock_sendall(sock, _frame("s0") + b"".join(ls.frame(kind, b"x")))

    seen, error = await _serve(send)
    assert seen == ["s0"] and isinstance(error, ValueError) and "expected a request frame" in str(error)
