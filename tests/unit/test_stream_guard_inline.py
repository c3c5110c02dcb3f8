"""`stream_guard` for a per-message rpc (`rpc_inference`): the method's own task reads each message (no reader task
and no queue per stream), under the same bounds and with the same answers as the read-ahead path."""

from __future__ import annotations

import asyncio

from hivemind.p2p import P2P, PeerID
from hivemind.proto import runtime_pb2

from corolla.server.core.limits import PeerLimitExceeded, PeerLimits
from corolla.server.front import stream_guard

CLIENT_PEER = PeerID(b"test-client")  # a peer id object, as p2pd reports a stream's peer


class _Writer:
    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.closed = False

    def write(self, data: bytes | memoryview) -> None:
        self.writes.append(bytes(data))

    async def drain(self) -> None:
        return None

    def close(self) -> None:
        self.closed = True


def _message(uid: str = "p.0", filler: int = 0) -> bytes:
    body = runtime_pb2.ExpertRequest(uid=uid, metadata=b"\x00" * filler).SerializeToString()
    return P2P.MESSAGE_MARKER + len(body).to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER) + body


END = P2P.ERROR_MARKER + (0).to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER)


def _handle(method, budget: stream_guard.StreamBudget, rejected: list) -> object:
    p2p = type("P2PStub", (), {"peer_id": "server"})()
    return stream_guard.guarded_stream_handler(
        p2p, "rpc_inference", method, budget, per_message=True, on_reject=lambda name, e: rejected.append(e)
    )


def test_a_per_message_stream_runs_in_one_task_and_answers_every_message() -> None:
    tasks_while_waiting: list[int] = []

    async def echo(requests, context):
        async for request in requests:
            tasks_while_waiting.append(len(asyncio.all_tasks()))
            yield runtime_pb2.ExpertResponse(metadata=request.uid.encode())

    async def run() -> tuple[_Writer, list, stream_guard.StreamBudget]:
        reader, writer, rejected = asyncio.StreamReader(), _Writer(), []
        budget = stream_guard.StreamBudget(PeerLimits())
        before = len(asyncio.all_tasks())  # this test's own task
        serving = asyncio.create_task(
            _handle(echo, budget, rejected)(type("Info", (), {"peer_id": CLIENT_PEER})(), reader, writer)
        )
        for uid in ("p.0", "p.1", "p.2"):
            reader.feed_data(_message(uid))
            await asyncio.sleep(0.01)
        reader.feed_data(END)
        await asyncio.wait_for(serving, 5)
        assert tasks_while_waiting == [before + 1] * 3  # the stream's handler alone: no reader task beside it
        return writer, rejected, budget

    writer, rejected, budget = asyncio.run(run())
    replies = [runtime_pb2.ExpertResponse.FromString(w[1 + P2P.HEADER_LEN :]) for w in writer.writes]
    assert [r.metadata for r in replies] == [b"p.0", b"p.1", b"p.2"]
    assert not rejected and budget.total_bytes == 0 and writer.closed


def test_a_message_over_the_limit_is_refused_after_the_method_ends_and_counted_once() -> None:
    seen: list[str] = []
    ended = []

    async def collect(requests, context):
        async for request in requests:
            seen.append(request.uid)
            yield runtime_pb2.ExpertResponse()
        ended.append(True)  # the refusal ends the input: the method finishes as at the end of a stream

    async def run() -> tuple[_Writer, list, stream_guard.StreamBudget]:
        reader, writer, rejected = asyncio.StreamReader(), _Writer(), []
        budget = stream_guard.StreamBudget(PeerLimits(max_stream_message_bytes=200))
        reader.feed_data(_message("p.0") + _message("p.1", filler=500))
        await asyncio.wait_for(
            _handle(collect, budget, rejected)(type("Info", (), {"peer_id": CLIENT_PEER})(), reader, writer), 5
        )
        return writer, rejected, budget

    writer, rejected, budget = asyncio.run(run())
    assert seen == ["p.0"] and ended == [True]
    assert len(rejected) == 1 and isinstance(rejected[0], PeerLimitExceeded)
    assert writer.writes[-1].startswith(P2P.ERROR_MARKER) and b"max_stream_message_bytes" in writer.writes[-1]
    assert budget.total_bytes == 0  # the refused message's charge is given back


def test_a_method_error_is_answered_and_the_rest_of_the_input_is_read_before_closing() -> None:
    async def refuse(requests, context):
        async for _ in requests:
            raise ValueError("bad step")
        yield runtime_pb2.ExpertResponse()

    async def run() -> tuple[_Writer, asyncio.StreamReader]:
        reader, writer, rejected = asyncio.StreamReader(), _Writer(), []
        budget = stream_guard.StreamBudget(PeerLimits())
        reader.feed_data(_message("p.0") + _message("p.1"))
        asyncio.get_running_loop().call_later(0.05, reader.feed_data, END)
        await asyncio.wait_for(
            _handle(refuse, budget, rejected)(type("Info", (), {"peer_id": CLIENT_PEER})(), reader, writer), 5
        )
        assert not rejected  # the method counts its own refusals
        return writer, reader

    writer, reader = asyncio.run(run())
    assert writer.writes[-1].startswith(P2P.ERROR_MARKER) and b"bad step" in writer.writes[-1]
    assert len(reader._buffer) == 0  # the second message and the end were read (and dropped) before closing


def test_a_caller_that_closes_mid_message_gets_no_answer() -> None:
    async def echo(requests, context):
        async for _ in requests:
            yield runtime_pb2.ExpertResponse()

    async def run() -> tuple[_Writer, list]:
        reader, writer, rejected = asyncio.StreamReader(), _Writer(), []
        budget = stream_guard.StreamBudget(PeerLimits())
        reader.feed_data(_message("p.0")[:-3])
        reader.feed_eof()
        await asyncio.wait_for(
            _handle(echo, budget, rejected)(type("Info", (), {"peer_id": CLIENT_PEER})(), reader, writer), 5
        )
        assert budget.total_bytes == 0
        return writer, rejected

    writer, rejected = asyncio.run(run())
    assert writer.writes == [] and rejected == [] and writer.closed
