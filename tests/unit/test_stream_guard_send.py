"""`stream_guard.send_message`: the bytes hivemind's `P2P.send_protobuf` writes (stock Petals clients read them), as
one write for a decode step's reply (one wake-up of p2pd per reply instead of three)."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch
from hivemind.p2p import P2P, PeerID
from hivemind.proto import runtime_pb2
from hivemind.proto.p2pd_pb2 import RPCError

from corolla.protocol.codecs import serialize_tensor
from corolla.server.core.limits import PeerLimits
from corolla.server.front import stream_guard
from corolla.server.front.stream_endpoint import StreamBudget

CLIENT_PEER = PeerID(b"test-client")  # a peer id object, as p2pd reports a stream's peer


class _Writer:
    def __init__(self) -> None:
        self.writes: list[bytes] = []

    def write(self, data: bytes | memoryview) -> None:
        self.writes.append(bytes(data))

    async def drain(self) -> None:
        return None


def _sent(send, message) -> _Writer:
    writer = _Writer()
    asyncio.run(send(message, writer))
    return writer


def _reply(hidden: int) -> runtime_pb2.ExpertResponse:
    return runtime_pb2.ExpertResponse(tensors=[serialize_tensor(torch.randn(1, 1, hidden))])


@pytest.mark.parametrize("message", [_reply(64), RPCError(message="refused: too long")], ids=["reply", "error"])
def test_a_step_reply_is_hivemind_framing_in_one_write(message):
    ours, theirs = _sent(stream_guard.send_message, message), _sent(P2P.send_protobuf, message)
    assert b"".join(ours.writes) == b"".join(theirs.writes)
    assert len(ours.writes) == 1 and len(theirs.writes) == 3


def test_a_large_reply_keeps_the_same_bytes_without_copying_its_body(monkeypatch):
    monkeypatch.setattr(stream_guard, "ONE_WRITE_MAX_BYTES", 1024)
    message = _reply(4096)  # 16 KiB body
    ours, theirs = _sent(stream_guard.send_message, message), _sent(P2P.send_protobuf, message)
    assert b"".join(ours.writes) == b"".join(theirs.writes)
    assert len(ours.writes) == 2 and len(ours.writes[0]) == 1 + P2P.HEADER_LEN


class _StreamWriter(_Writer):
    def __init__(self, reader: asyncio.StreamReader) -> None:
        super().__init__()
        self.reader = reader
        self.end_sent = False  # the caller has written its end-of-stream
        self.unread_at_close: int | None = None
        self.end_sent_at_close = False

    def close(self) -> None:
        self.unread_at_close = len(self.reader._buffer)  # what a real socket would still hold when it closes
        self.end_sent_at_close = self.end_sent


def _serve_refusing_stream(end_delay_s: float) -> tuple[_StreamWriter, float]:
    """A forward stream whose handler refuses its second part while the caller's end-of-stream is still on its way
    (`end_delay_s` later); returns the writer and how long the handler took."""

    async def refuse_second(requests, context):
        count = 0
        async for _ in requests:
            count += 1
            if count == 2:
                raise ValueError("every part must name the same uid")
        yield runtime_pb2.ExpertResponse()

    async def run() -> tuple[_StreamWriter, float]:
        reader = asyncio.StreamReader()
        writer = _StreamWriter(reader)
        budget = StreamBudget(PeerLimits())
        p2p = type("P2PStub", (), {"peer_id": "server"})()
        handle = stream_guard.guarded_stream_handler(
            p2p, "rpc_forward_stream", refuse_second, budget, on_reject=lambda *_: None
        )
        body = runtime_pb2.ExpertRequest(uid="p.0").SerializeToString()
        part = P2P.MESSAGE_MARKER + len(body).to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER) + body
        reader.feed_data(part + part)
        end = P2P.ERROR_MARKER + (0).to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER)

        def send_end() -> None:
            reader.feed_data(end)
            writer.end_sent = True

        asyncio.get_running_loop().call_later(end_delay_s, send_end)
        info = type("StreamInfo", (), {"peer_id": CLIENT_PEER})()
        started = time.monotonic()
        await asyncio.wait_for(handle(info, reader, writer), 5.0)
        writer.close()  # what hivemind does when the handler returns
        return writer, time.monotonic() - started

    return asyncio.run(run())


def test_a_refused_stream_reads_the_callers_end_before_it_closes():
    """Closing a unix socket with unread bytes resets it, and p2pd may then drop the refusal it has not delivered
    (the caller saw a broken pipe instead of the error): the handler reads the caller's end-of-stream first."""
    writer, _ = _serve_refusing_stream(end_delay_s=0.05)
    sent = b"".join(writer.writes)
    assert sent.startswith(P2P.ERROR_MARKER) and b"same uid" in sent
    assert writer.end_sent_at_close and writer.unread_at_close == 0  # the end arrived and was read before closing


def test_a_caller_that_never_ends_its_input_is_not_waited_for_long():
    writer, elapsed_s = _serve_refusing_stream(end_delay_s=30.0)
    assert b"same uid" in b"".join(writer.writes)
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

    async def run() -> _StreamWriter:
        reader = asyncio.StreamReader()
        writer = _StreamWriter(reader)
        budget = StreamBudget(PeerLimits())
        p2p = type("P2PStub", (), {"peer_id": "server"})()
        handle = stream_guard.guarded_stream_handler(
            p2p, "rpc_backward_stream", fails_on_cancelled_future, budget, on_reject=lambda *_: None
        )
        body = runtime_pb2.ExpertRequest(uid="p.0").SerializeToString()
        reader.feed_data(P2P.MESSAGE_MARKER + len(body).to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER) + body)
        reader.feed_data(P2P.ERROR_MARKER + (0).to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER))
        info = type("StreamInfo", (), {"peer_id": CLIENT_PEER})()
        await asyncio.wait_for(handle(info, reader, writer), 5.0)
        return writer

    sent = b"".join(asyncio.run(run()).writes)
    assert sent.startswith(P2P.ERROR_MARKER) and b"cancelled" in sent
