"""The lean per-step stream path without a network: a p2pd stream's reads (`FrameConnection` with hivemind's framing:
a silent peer is cut off between the parts of a request and inside a message, each read after its own timeout; a
complete message is charged before its body is read), and a session's wait for its next step (`StepOrder`, no task:
the step timeout ends it, the session timeout and an eviction end it with their errors, a request arriving in time is
run)."""

from __future__ import annotations

import asyncio
import socket
import sys
import time
from collections.abc import AsyncIterator

import pytest
from hivemind.p2p import P2P
from hivemind.proto import runtime_pb2
from hivemind.utils.serializer import MSGPackSerializer

from corolla.protocol import local_stream as ls
from corolla.server.core.admission import SessionTicket
from corolla.server.core.executor import SessionSpec
from corolla.server.core.limits import PeerLimitExceeded, PeerLimits, SessionEvicted, SessionTimeouts, StreamStalled
from corolla.server.core.peer_bytes import StreamBudget, StreamLease
from corolla.server.core.push_guard import SessionPushGuard
from corolla.server.front.inference_stream import SessionState, StepOrder
from corolla.server.front.stream_endpoint import FrameConnection, PeerFrames

BOUND_S = 3.0  # every wait below is bounded: a read that ignores its deadline fails the test instead of hanging


def _framed(message: runtime_pb2.ExpertRequest) -> bytes:
    body = message.SerializeToString()
    return P2P.MESSAGE_MARKER + len(body).to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER) + body


def _lease(max_message_bytes: int = 1 << 20) -> StreamLease:
    return StreamLease(StreamBudget(PeerLimits(max_stream_message_bytes=max_message_bytes)), "peer")


async def _peer_conn() -> tuple[FrameConnection, socket.socket]:
    """A p2pd stream's connection as the server reads it (`FrameConnection` with hivemind's framing, `PeerFrames`)
    over a socket pair, and the caller's end."""
    ours, theirs = socket.socketpair()
    theirs.setblocking(False)
    _, conn = await asyncio.get_running_loop().connect_accepted_socket(
        lambda: FrameConnection(header_bytes=PeerFrames.header_bytes, parse_header=PeerFrames.parse_header), ours
    )
    return conn, theirs


async def test_a_silent_peer_is_cut_off_between_the_parts_of_a_request() -> None:
    conn, theirs = await _peer_conn()  # nothing ever arrives
    loop = asyncio.get_running_loop()
    # the idle bound fired, not the test's (BOUND_S: TimeoutError); no wall-clock assert (a loaded VM)
    with pytest.raises(StreamStalled, match="stream_idle_timeout=0.2 s"):  # a part of a request: from the wait
        await asyncio.wait_for(conn.read_frame(sys.maxsize, idle_s=0.2, since=loop.time()), BOUND_S)
    conn.close()
    theirs.close()


async def test_a_peer_that_stops_inside_a_message_is_cut_off() -> None:
    conn, theirs = await _peer_conn()
    message = _framed(runtime_pb2.ExpertRequest(uid="p.0", metadata=b"x" * 100))
    await asyncio.get_running_loop().sock_sendall(theirs, message[:-10])  # all but the last bytes of the body
    lease = _lease()
    with pytest.raises(StreamStalled, match="stream_idle_timeout=0.2 s inside a message"):
        await asyncio.wait_for(conn.read_frame(sys.maxsize, charge=lease.charge, idle_s=0.2), BOUND_S)
    assert lease.held == len(message) - 1 - P2P.HEADER_LEN  # charged before the body was read
    conn.close()
    theirs.close()


async def test_each_read_gets_its_own_idle_timeout() -> None:
    """A slow peer whose pauses are each under the idle timeout (their sum is not) is read to the end."""
    conn, theirs = await _peer_conn()
    request = runtime_pb2.ExpertRequest(uid="p.0", metadata=b"y" * 300)
    message = _framed(request)

    async def trickle() -> None:
        for start in range(0, len(message), 100):
            await asyncio.get_running_loop().sock_sendall(theirs, message[start : start + 100])
            await asyncio.sleep(0.12)

    feeding = asyncio.create_task(trickle())
    kind, payload = await asyncio.wait_for(conn.read_frame(sys.maxsize, idle_s=0.3), BOUND_S)
    await feeding
    assert kind == ls.MESSAGE and runtime_pb2.ExpertRequest.FromString(payload) == request
    conn.close()
    theirs.close()


async def test_a_complete_message_is_read_and_charged_and_the_end_is_the_end() -> None:
    conn, theirs = await _peer_conn()
    request = runtime_pb2.ExpertRequest(uid="p.0 p.1", metadata=b"m")
    end = P2P.ERROR_MARKER + (0).to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER)
    await asyncio.get_running_loop().sock_sendall(theirs, _framed(request) + end)
    lease = _lease()
    kind, payload = await asyncio.wait_for(conn.read_frame(sys.maxsize, charge=lease.charge, idle_s=0.2), BOUND_S)
    assert kind == ls.MESSAGE and runtime_pb2.ExpertRequest.FromString(payload) == request
    assert request.ByteSize() == lease.held
    kind, payload = await asyncio.wait_for(conn.read_frame(sys.maxsize, charge=lease.charge, idle_s=0.2), BOUND_S)
    assert kind == ls.END and payload == b"" and lease.held == request.ByteSize()  # the end is not charged
    conn.close()
    theirs.close()


async def test_an_oversized_declared_length_is_refused_before_the_body() -> None:
    conn, theirs = await _peer_conn()
    await asyncio.get_running_loop().sock_sendall(
        theirs, P2P.MESSAGE_MARKER + (1 << 30).to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER)
    )
    lease = _lease(max_message_bytes=1 << 20)
    with pytest.raises(PeerLimitExceeded, match="max_stream_message_bytes"):
        await asyncio.wait_for(conn.read_frame(sys.maxsize, charge=lease.charge, idle_s=0.2), BOUND_S)
    assert lease.held == 0
    conn.close()
    theirs.close()


def _step(step_id: str) -> runtime_pb2.ExpertRequest:
    tensor = runtime_pb2.Tensor(buffer=b"x", size=[1], dtype="float32")
    return runtime_pb2.ExpertRequest(
        uid="p.0", tensors=[tensor], metadata=MSGPackSerializer.dumps({"step_id": step_id})
    )


def _session(ticket: SessionTicket | None = None) -> SessionState:
    return SessionState(
        session_id="s", spec=SessionSpec((0,), 1, 8), cache=None, active_adapter="",
        args_structure=None, push_guard=SessionPushGuard(), ticket=ticket,
    )  # fmt: skip


async def _client(delays_s: list[float]) -> AsyncIterator[runtime_pb2.ExpertRequest]:
    for i, delay_s in enumerate(delays_s):
        await asyncio.sleep(delay_s)
        yield _step(f"s{i + 1}")
    await asyncio.sleep(60)  # then silent


async def _steps(session: SessionState, delays_s: list[float], *, step_s: float, session_s: float) -> list[str]:
    """The step ids a `StepOrder` runs of a client sending "s0", then "s1"... after `delays_s`, then nothing; raises
    the error the session ends with."""
    timeouts = SessionTimeouts(step_timeout_s=step_s, session_timeout_s=session_s, request_timeout_s=5)
    deadline = time.monotonic() + session_s
    seen: list[str] = []
    ended: asyncio.Future = asyncio.get_running_loop().create_future()

    def run(_request: runtime_pb2.ExpertRequest, metadata) -> bool:
        seen.append(metadata.step_id)
        return True

    def end(error: BaseException | None) -> None:
        if error is None:
            ended.set_result(None)
        else:
            ended.set_exception(error)

    order = StepOrder(session, timeouts, deadline, None, run=run, ready=lambda: None, end=end)

    async def feed() -> None:
        async for request in _client(delays_s):
            order.client(request)

    feeding = asyncio.create_task(feed())
    order.client(_step("s0"))
    try:
        await ended
    finally:
        feeding.cancel()
        order.close()
    return seen


async def test_a_session_ends_at_the_step_timeout() -> None:
    # BOUND_S (3 s) against the 30 s session timeout: only the 0.3 s step timeout can end it in time
    seen = await asyncio.wait_for(_steps(_session(), [0.05, 0.1], step_s=0.3, session_s=30), BOUND_S)
    assert seen == ["s0", "s1", "s2"]


async def test_a_session_waiting_past_its_deadline_ends_with_timeout_error() -> None:
    with pytest.raises(TimeoutError, match="session_timeout"):
        await asyncio.wait_for(_steps(_session(), [0.05], step_s=10, session_s=0.4), BOUND_S)


async def test_a_waiting_session_ends_with_its_eviction() -> None:
    ticket = SessionTicket(peer="p", reserved_bytes=1)
    asyncio.get_running_loop().call_later(0.2, ticket.evict, "idle under memory pressure")
    with pytest.raises(SessionEvicted, match="idle under memory pressure"):
        await asyncio.wait_for(_steps(_session(ticket), [], step_s=10, session_s=30), BOUND_S)
