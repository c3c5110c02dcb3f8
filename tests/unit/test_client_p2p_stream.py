"""The client's p2pd stream without a daemon: its frames are the bytes hivemind writes (one write instead of three),
responses are parsed in pieces with their lengths bounded, the server's error and the end of the stream are told
apart, a silent server fails the liveness check, and STREAM_OPEN is spoken as hivemind speaks it (a fake p2pd on a
unix socket). Also the step path's shortcuts: `all_finite`, the cached empty-tensor serialization and the
pre-packed args_structure (the request's metadata bytes unchanged)."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from pathlib import Path

import pytest
import torch
from hivemind.p2p import P2P, P2PHandlerError, PeerID
from hivemind.proto import p2pd_pb2, runtime_pb2
from hivemind.utils.multiaddr import Multiaddr

from corolla.client.calls.output_checks import all_finite
from corolla.client.calls.remote_forward_backward import serialize_activations
from corolla.client.config import ClientConfig
from corolla.client.routing.sequence_manager import RemoteSequenceManager
from corolla.client.session.span_session import SpanSession
from corolla.client.transport.p2p_stream import (
    END_OF_STREAM_FRAME,
    INFERENCE_HANDLE,
    MAX_ERROR_BYTES,
    P2PInferenceStream,
    request_frame,
)
from corolla.protocol.codecs import serialize_tensor
from corolla.protocol.metadata import decode_metadata, encode_metadata
from corolla.protocol.packing import pack_args_kwargs
from corolla.protocol.records import RemoteSpanInfo, ServerInfo, ServerState

PEER = "12D3KooWBNitLprcTBawSZBqZrrFMcka27mVwJcgm6LBUWMRXLq1"


class _Writes:
    """A StreamWriter stand-in recording each write hivemind makes."""

    def __init__(self) -> None:
        self.writes: list[bytes] = []

    def write(self, data: bytes) -> None:
        self.writes.append(bytes(data))

    async def drain(self) -> None:
        return None


def _hivemind_writes(message) -> list[bytes]:
    writer = _Writes()
    coroutine = P2P.send_protobuf(message, writer)
    with pytest.raises(StopIteration):  # it never waits (drain returns at once): runs inside any loop or none
        coroutine.send(None)
    return writer.writes


def _request() -> runtime_pb2.ExpertRequest:
    return runtime_pb2.ExpertRequest(
        uid="m.0 m.1", tensors=[serialize_tensor(torch.arange(8.0).view(1, 1, 8))], metadata=b"\x81\xa1a\x01"
    )


def test_frames_are_hivemind_bytes_in_one_write() -> None:
    request = _request()
    writes = _hivemind_writes(request)
    assert len(writes) == 3  # marker, length, message: three wake-ups of p2pd per step
    assert request_frame(request) == b"".join(writes)
    assert END_OF_STREAM_FRAME == b"".join(_hivemind_writes(P2P.END_OF_STREAM))


def _pair() -> tuple[P2PInferenceStream, socket.socket]:
    ours, theirs = socket.socketpair()
    ours.setblocking(False)
    return P2PInferenceStream(ours, PEER), theirs


def test_exchange_reads_hivemind_responses_in_pieces_and_errors() -> None:
    stream, server = _pair()
    response = runtime_pb2.ExpertResponse(tensors=[serialize_tensor(torch.ones(1, 1, 8))])
    data = b"".join(_hivemind_writes(response))

    def serve() -> None:
        header = server.recv(9)
        assert header[0] == 0
        assert runtime_pb2.ExpertRequest.FromString(server.recv(int.from_bytes(header[1:], "big"))).uid == "m.0 m.1"
        for i in range(0, len(data), 5):  # dribble the response
            server.sendall(data[i : i + 5])
            time.sleep(0.001)

    thread = threading.Thread(target=serve)
    thread.start()
    try:
        assert stream.exchange(_request(), timeout_s=5) == response
    finally:
        thread.join(5)
    try:
        server.sendall(b"".join(_hivemind_writes(p2pd_pb2.RPCError(message="Maximum length exceeded"))))
        with pytest.raises(P2PHandlerError, match="Maximum length exceeded"):
            stream.exchange(_request(), timeout_s=5)
        server.close()  # a closed connection is the end of the stream
        with pytest.raises(ConnectionError):
            stream.exchange(_request(), timeout_s=5)
    finally:
        stream.close()
        server.close()


@pytest.mark.parametrize(
    "header",
    [
        b"\x00" + (2**40).to_bytes(8, "big"),  # a message far over the limit
        b"\x01" + (MAX_ERROR_BYTES + 1).to_bytes(8, "big"),  # an error message over its limit
        b"\x07" + (4).to_bytes(8, "big"),  # a marker no hivemind peer sends
    ],
)
def test_hostile_frames_fail_before_any_allocation(header: bytes) -> None:
    stream, server = _pair()
    try:
        server.sendall(header)
        with pytest.raises(ConnectionError):
            stream.exchange(_request(), timeout_s=5)
        assert len(stream._buffer) == len(header)  # nothing was read or allocated for the announced payload
    finally:
        stream.close()
        server.close()


class _Pinging:
    """A `ReplyWaiter` that asks `alive()` every `period_s` of waiting (ConnectionError where it says no)."""

    def __init__(self, alive, period_s: float) -> None:
        self.alive, self.period_s = alive, period_s
        self.next_s = time.monotonic() + period_s
        self.wakes: list[tuple[float, float]] = []

    def wake_at(self, now_s: float) -> float:
        return max(now_s, self.next_s)

    def woke(self, asked_s: float, now_s: float) -> None:
        self.wakes.append((asked_s, now_s))

    def idle(self) -> None:
        if time.monotonic() >= self.next_s:
            if not self.alive():
                raise ConnectionError("the server stopped answering pings")
            self.next_s = time.monotonic() + self.period_s


def test_silent_server_fails_the_liveness_check_and_a_live_one_is_awaited() -> None:
    stream, server = _pair()
    checks: list[float] = []
    try:
        started = time.monotonic()
        with pytest.raises(ConnectionError, match="pings"):
            stream.exchange(_request(), timeout_s=30, waiter=_Pinging(lambda: checks.append(time.monotonic()), 0.05))
        assert len(checks) == 1 and checks[0] - started >= 0.05 and time.monotonic() - started < 5
        response = runtime_pb2.ExpertResponse(tensors=[serialize_tensor(torch.zeros(1, 1, 8))])
        alive: list[float] = []
        stream2, server2 = _pair()
        threading.Timer(0.3, lambda: server2.sendall(b"".join(_hivemind_writes(response)))).start()
        try:
            waiter = _Pinging(lambda: alive.append(1) or True, 0.05)
            got = stream2.exchange(_request(), timeout_s=30, waiter=waiter)
            assert got == response and len(alive) >= 2  # pinged while waiting, kept waiting
            # each sleep asked to end no later than the waiter's next ping (in slices)
            assert all(asked <= waiter.next_s for asked, _ in waiter.wakes)
        finally:
            stream2.close()
            server2.close()
    finally:
        stream.close()
        server.close()


def test_async_side_sends_one_frame_and_reads_until_the_end() -> None:
    response = runtime_pb2.ExpertResponse(tensors=[serialize_tensor(torch.ones(2, 1, 8))])

    async def go() -> None:
        stream, server = _pair()
        try:
            request = _request()
            await stream.send(request)
            await stream.send_end()
            expected = request_frame(request) + END_OF_STREAM_FRAME
            got = b""
            while len(got) < len(expected):
                got += server.recv(1 << 16)
            assert got == expected
            server.sendall(b"".join(_hivemind_writes(response)))
            server.close()
            assert await stream.receive() == response
            assert await stream.receive() is None
        finally:
            stream.close()
            server.close()

    asyncio.run(go())


class _FakeDaemon:
    """Speaks p2pd's control protocol for one STREAM_OPEN, then echoes the stream back."""

    def __init__(self, path: Path, error: str | None = None):
        self.error, self.requests = error, []
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(str(path))
        self.listener.listen(1)
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        conn, _ = self.listener.accept()
        with conn:
            length, shift = 0, 0
            while True:
                byte = conn.recv(1)[0]
                length |= (byte & 0x7F) << shift
                shift += 7
                if not byte & 0x80:
                    break
            data = b""
            while len(data) < length:
                data += conn.recv(length - len(data))
            self.requests.append(p2pd_pb2.Request.FromString(data))
            if self.error is not None:
                reply = p2pd_pb2.Response(type=p2pd_pb2.Response.ERROR, error=p2pd_pb2.ErrorResponse(msg=self.error))
            else:
                reply = p2pd_pb2.Response(type=p2pd_pb2.Response.OK)
            raw = reply.SerializeToString()
            conn.sendall(bytes([len(raw)]) + raw)
            while chunk := conn.recv(1 << 16):
                conn.sendall(chunk)


class _P2P:
    def __init__(self, path: Path):
        self.daemon_listen_maddr = Multiaddr(f"/unix{path}")


def test_stream_open_speaks_p2pd_control_and_reports_its_error(tmp_path: Path) -> None:
    async def go(path: Path, error: str | None) -> runtime_pb2.ExpertResponse | None:
        daemon = _FakeDaemon(path, error)
        try:
            stream = await asyncio.wait_for(P2PInferenceStream.open(_P2P(path), PEER), 5)  # type: ignore[arg-type]
        finally:
            daemon.listener.close()
        try:
            request = daemon.requests[0]
            assert request.type == p2pd_pb2.Request.STREAM_OPEN
            assert list(request.streamOpen.proto) == [INFERENCE_HANDLE]
            assert request.streamOpen.peer == PeerID.from_base58(PEER).to_bytes()
            # the daemon echoes our frame: a request with only tensors parses as a response with those tensors
            await stream.send(runtime_pb2.ExpertRequest(tensors=_request().tensors))
            return await asyncio.wait_for(stream.receive(), 5)
        finally:
            stream.close()

    assert asyncio.run(go(tmp_path / "d1.sock", None)) == runtime_pb2.ExpertResponse(tensors=_request().tensors)
    with pytest.raises(ConnectionError, match="no route"):
        asyncio.run(go(tmp_path / "d2.sock", "no route to peer"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_all_finite_matches_torch(dtype: torch.dtype) -> None:
    x = torch.randn(2, 3, 16).to(dtype)
    extremes = torch.tensor([torch.finfo(dtype).max, -torch.finfo(dtype).max, torch.finfo(dtype).tiny, -0.0])
    assert all_finite(x) and all_finite(x[:, 1:]) and all_finite(extremes.to(dtype))
    for bad in (float("nan"), float("inf"), float("-inf")):
        y = x.clone()
        y[1, 2, 5] = bad
        assert not all_finite(y) and not all_finite(y[:, 2:])
    assert all_finite(torch.ones(3, requires_grad=True).to(dtype))


def test_cached_empty_tensors_serialize_as_before() -> None:
    hidden = torch.randn(1, 1, 8)
    for empty in (torch.empty(0), torch.empty(0, dtype=torch.int64), torch.empty(1, 0, 8, dtype=torch.bfloat16)):
        for compression in (runtime_pb2.CompressionType.NONE, runtime_pb2.CompressionType.FLOAT16):
            first = serialize_activations([hidden, empty], compression)
            again = serialize_activations([hidden, empty], compression)
            assert first[1] == again[1] == serialize_tensor(empty, runtime_pb2.CompressionType.NONE)
            assert first[0] == serialize_tensor(hidden, compression)


def test_step_requests_keep_hivemind_metadata_bytes() -> None:
    manager = RemoteSequenceManager(ClientConfig(), ["m.0", "m.1"], start_updates=False)
    span = RemoteSpanInfo(PEER, 0, 2, ServerInfo(ServerState.ONLINE, 1.0, start_block=0, end_block=2))
    session = SpanSession(manager, span, max_length=64)
    hidden, prompts, hypo_ids = torch.randn(1, 1, 8), torch.empty(0), torch.empty(0, dtype=torch.int64)
    for started in (False, True):
        session.started = started
        request, inputs, send_from = session.build_request(
            hidden, 0, 0, prompts, hypo_ids, "step-1", runtime_pb2.CompressionType.NONE, {"corolla.x": [1, (2, 3)]}
        )
        metadata = decode_metadata(request.metadata)
        assert metadata["args_structure"] == pack_args_kwargs(hidden, prompts, hypo_ids)[1]
        assert encode_metadata(metadata) == request.metadata  # the bytes hivemind's serializer writes for the dict
        assert ("max_length" in metadata) == (not started) and inputs is hidden and send_from == 0
    request, _, _ = session.build_request(
        hidden, 0, 0, prompts, prompts, "step-2", runtime_pb2.CompressionType.NONE, {}
    )
    structure = decode_metadata(request.metadata)["args_structure"]
    assert structure == ((b"__T0", b"__T1", b"__T1"), {}) and len(request.tensors) == 2  # one object, one marker
