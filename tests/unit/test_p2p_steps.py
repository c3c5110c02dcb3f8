"""`stream_guard.steps_handler`: a p2p `rpc_inference` stream's connection taken from hivemind's reader (what it had
buffered too) and its steps run by callbacks (`stream_endpoint.PeerStreamPort`: no reader task and no task per step),
under the same bounds and with the same answers as before: a message over a byte budget refused after the session
ends and counted once, its bytes given back; the session's error answered, the rest of the caller's input read
before the stream closes; a caller that closes mid-message gets no answer."""

from __future__ import annotations

import asyncio
import socket
import sys

from hivemind.p2p import P2P, PeerID
from hivemind.proto import runtime_pb2
from hivemind.proto.p2pd_pb2 import RPCError

from corolla.protocol import local_stream as ls
from corolla.server.core.limits import PeerLimitExceeded, PeerLimits, StreamStalled
from corolla.server.core.peer_bytes import StreamBudget
from corolla.server.front import stream_endpoint, stream_guard
from corolla.server.front.stream_endpoint import FrameConnection, PeerFrames, PeerStreamPort

CLIENT_PEER = PeerID(b"test-client")  # a peer id object, as p2pd reports a stream's peer
BOUND_S = 5.0


def _message(uid: str = "p.0", filler: int = 0) -> bytes:
    body = runtime_pb2.ExpertRequest(uid=uid, metadata=b"\x00" * filler).SerializeToString()
    return P2P.MESSAGE_MARKER + len(body).to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER) + body


END = P2P.ERROR_MARKER + (0).to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER)


class _EchoOrder:
    """Stands in for a session's `StepOrder`: each request answered at once from the port's callback."""

    def __init__(self, port, done: asyncio.Future, seen: list, tasks: list[int]):
        self.port, self.done, self.seen, self.tasks, self.ended = port, done, seen, tasks, False

    def client(self, request: runtime_pb2.ExpertRequest | None) -> None:
        if request is None:  # the end of the input (the caller's, or a refusal's)
            self.ended = True
            if not self.done.done():
                self.done.set_result(None)
            return
        self.seen.append(request.uid)
        self.tasks.append(len(asyncio.all_tasks()))
        self.port.reply(runtime_pb2.ExpertResponse(metadata=request.uid.encode()))
        self.port.ready()

    def fail(self, error: BaseException) -> None:
        self.ended = True
        if not self.done.done():
            self.done.set_exception(error)


def _echo(seen: list, tasks: list[int]):
    async def serve(requests, context, port) -> None:
        first = await requests.__anext__()  # the session's opening request, read as a message
        done = asyncio.get_running_loop().create_future()
        order = _EchoOrder(port, done, seen, tasks)
        port.attach(order, requests)
        order.client(first)
        await done

    return serve


async def _serve(serve, budget: StreamBudget, send, rejected: list, transports: list | None = None) -> bytes:
    """Serves one stream of what `send(client_socket)` sends, as hivemind's listener hands it over (a reader that
    may have buffered its first bytes, a writer); returns all the client read up to the stream's clean close."""
    loop = asyncio.get_running_loop()
    ours, theirs = socket.socketpair()
    theirs.setblocking(False)
    reader, writer = await asyncio.open_unix_connection(sock=ours)
    if transports is not None:
        transports.append(writer.transport)
    p2p = type("P2PStub", (), {"peer_id": "server"})()
    handle = stream_guard.steps_handler(
        p2p, "rpc_inference", serve, budget, on_reject=lambda name, e: rejected.append(e)
    )
    sending = asyncio.create_task(send(theirs))
    await asyncio.sleep(0.02)  # (the reader buffers what came first: the handler takes it over)
    info = type("Info", (), {"peer_id": CLIENT_PEER})()
    await asyncio.wait_for(handle(info, reader, writer), BOUND_S)
    await asyncio.wait_for(sending, BOUND_S)
    received = b""
    while chunk := await asyncio.wait_for(loop.sock_recv(theirs, 1 << 16), BOUND_S):  # a reset raises here
        received += chunk
    theirs.close()
    return received


def _frames(data: bytes) -> list[tuple[bytes, bytes]]:
    frames = []
    while data:
        length = int.from_bytes(data[1 : 1 + P2P.HEADER_LEN], P2P.BYTEORDER)
        frames.append((data[:1], data[1 + P2P.HEADER_LEN : 1 + P2P.HEADER_LEN + length]))
        data = data[1 + P2P.HEADER_LEN + length :]
    return frames


def test_a_stream_of_steps_runs_in_one_task_and_answers_every_message() -> None:
    seen: list[str] = []
    tasks: list[int] = []

    async def send(sock: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        for uid in ("p.0", "p.1", "p.2"):
            await loop.sock_sendall(sock, _message(uid))
            await asyncio.sleep(0.01)
        await loop.sock_sendall(sock, END)

    async def run() -> tuple[bytes, list, StreamBudget, int]:
        budget, rejected = StreamBudget(PeerLimits()), []
        before = len(asyncio.all_tasks())  # this test's own task
        received = await _serve(_echo(seen, tasks), budget, send, rejected)
        return received, rejected, budget, before

    received, rejected, budget, before = asyncio.run(run())
    # the handler's task and the sender's: no reader task, no task per step
    assert seen == ["p.0", "p.1", "p.2"] and tasks[1:] == [before + 2] * 2
    frames = _frames(received)
    assert [m for m, _ in frames] == [P2P.MESSAGE_MARKER] * 3
    assert [runtime_pb2.ExpertResponse.FromString(b).metadata for _, b in frames] == [b"p.0", b"p.1", b"p.2"]
    assert not rejected and budget.total_bytes == 0


def test_a_message_over_the_limit_is_refused_after_the_session_ends_and_counted_once() -> None:
    seen: list[str] = []

    async def send(sock: socket.socket) -> None:
        await asyncio.get_running_loop().sock_sendall(sock, _message("p.0") + _message("p.1", filler=500))

    async def run() -> tuple[bytes, list, StreamBudget]:
        budget, rejected = StreamBudget(PeerLimits(max_stream_message_bytes=200)), []
        return await _serve(_echo(seen, []), budget, send, rejected), rejected, budget

    received, rejected, budget = asyncio.run(run())
    assert seen == ["p.0"]  # the refusal ended the input: the session ended as at the end of its stream
    assert len(rejected) == 1 and isinstance(rejected[0], PeerLimitExceeded)
    marker, body = _frames(received)[-1]
    assert marker == P2P.ERROR_MARKER and "max_stream_message_bytes" in RPCError.FromString(body).message
    assert budget.total_bytes == 0  # the refused message's charge is given back


def test_a_session_error_is_answered_and_the_rest_of_the_input_is_read_before_closing() -> None:
    async def refuse(requests, context, port) -> None:
        await requests.__anext__()
        raise ValueError("bad step")

    async def send(sock: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        await loop.sock_sendall(sock, _message("p.0") + _message("p.1"))
        await asyncio.sleep(0.05)
        await loop.sock_sendall(sock, END)

    async def run() -> tuple[bytes, list]:
        budget, rejected = StreamBudget(PeerLimits()), []
        received = await _serve(refuse, budget, send, rejected)
        assert budget.total_bytes == 0
        return received, rejected

    received, rejected = asyncio.run(run())  # (a close with unread bytes would reset: the read above raises)
    assert not rejected  # the session counts its own refusals
    marker, body = _frames(received)[-1]
    assert marker == P2P.ERROR_MARKER and RPCError.FromString(body).message == "bad step"


def test_a_session_error_sent_to_a_peer_is_cut_to_the_error_limit_as_the_sockets_is() -> None:
    text = "é" * (ls.MAX_ERROR_BYTES * 8)  # (2-byte characters: the cut must not split one)

    async def refuse(requests, context, port) -> None:
        await requests.__anext__()
        raise ValueError(text)

    async def send(sock: socket.socket) -> None:
        await asyncio.get_running_loop().sock_sendall(sock, _message("p.0") + END)

    async def run() -> bytes:
        return await _serve(refuse, StreamBudget(PeerLimits()), send, [])

    marker, body = _frames(asyncio.run(run()))[-1]
    message = RPCError.FromString(body).message
    assert marker == P2P.ERROR_MARKER and len(body) <= ls.MAX_ERROR_BYTES  # what a client reads as an error
    assert message and text.startswith(message) and "\ufffd" not in message


def test_a_peer_holds_at_most_max_opening_streams_per_peer_streams_before_their_sessions_open() -> None:
    """Streams whose first request has not come count against the cap; one whose session opened (attached) or that
    ended does not; a stream past the cap is refused at once, counted, and answered why."""

    async def run() -> tuple[bytes, bytes, list]:
        loop = asyncio.get_running_loop()
        budget, rejected = StreamBudget(PeerLimits(max_opening_streams_per_peer=2)), []
        p2p = type("P2PStub", (), {"peer_id": "server"})()
        handle = stream_guard.steps_handler(
            p2p, "rpc_inference", _echo([], []), budget, on_reject=lambda name, e: rejected.append(e)
        )
        info = type("Info", (), {"peer_id": CLIENT_PEER})()

        async def start(first: bytes) -> tuple[socket.socket, asyncio.Task]:
            ours, theirs = socket.socketpair()
            theirs.setblocking(False)
            reader, writer = await asyncio.open_unix_connection(sock=ours)
            await loop.sock_sendall(theirs, first)
            served = asyncio.create_task(handle(info, reader, writer))
            await asyncio.sleep(0.05)
            return theirs, served

        async def finish(sock: socket.socket, served: asyncio.Task, last: bytes = END) -> bytes:
            await loop.sock_sendall(sock, last)
            await asyncio.wait_for(served, BOUND_S)
            received = b""
            while chunk := await asyncio.wait_for(loop.sock_recv(sock, 1 << 16), BOUND_S):
                received += chunk
            sock.close()
            return received

        opened = [await start(_message(f"open.{i}")) for i in range(3)]  # sessions open: not counted
        waiting = [await start(b"") for _ in range(2)]  # no first request yet: the cap
        refused = await finish(*await start(_message("over")))
        waiting[0][0].close()  # one waiting caller goes away: its stream ends and leaves the count
        await asyncio.wait_for(waiting[0][1], BOUND_S)
        served = await finish(*await start(_message("after")))
        for sock, task in [*opened, waiting[1]]:
            await finish(sock, task, last=_message("late") + END)
        assert not budget.total_bytes
        return refused, served, rejected

    refused, served, rejected = asyncio.run(run())
    assert len(rejected) == 1 and getattr(rejected[0], "reason", None) == "peer_opening_streams"
    marker, body = _frames(refused)[-1]
    assert marker == P2P.ERROR_MARKER and "max_opening_streams_per_peer=2" in RPCError.FromString(body).message
    assert [runtime_pb2.ExpertResponse.FromString(b).metadata for _, b in _frames(served)] == [b"after"]


def test_a_caller_that_closes_mid_message_gets_no_answer() -> None:
    async def send(sock: socket.socket) -> None:
        await asyncio.get_running_loop().sock_sendall(sock, _message("p.0") + _message("p.1")[:-3])
        sock.shutdown(socket.SHUT_WR)

    async def run() -> tuple[bytes, list, StreamBudget]:
        budget, rejected = StreamBudget(PeerLimits()), []
        return await _serve(_echo([], []), budget, send, rejected), rejected, budget

    received, rejected, budget = asyncio.run(run())
    assert [runtime_pb2.ExpertResponse.FromString(b).metadata for _, b in _frames(received)] == [b"p.0"]
    assert rejected == [] and budget.total_bytes == 0


def test_a_step_reply_is_the_bytes_hivemind_writes() -> None:
    """A stock Petals client reads the replies with hivemind's `P2P.receive_protobuf`."""
    response = runtime_pb2.ExpertResponse(tensors=[runtime_pb2.Tensor(buffer=b"\x01" * 100, size=[1, 1, 50])])
    body = response.SerializeToString()
    expected = P2P.MESSAGE_MARKER + len(body).to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER) + body
    assert b"".join(PeerFrames().encode(ls.MESSAGE, body)) == expected
    assert PeerFrames.parse_header(expected, 1 << 20) == (ls.MESSAGE, len(body))


def test_a_caller_that_stops_inside_a_header_is_cut_off_and_answered() -> None:
    """A frame begun must come whole within `stream_idle_timeout_s` of its last byte, its header too (a stalled peer
    holds no session until the step timeout)."""

    async def send(sock: socket.socket) -> None:
        await asyncio.get_running_loop().sock_sendall(sock, _message("p.0") + _message("p.1")[:4])
        await asyncio.sleep(1.0)  # (the stream is over by then)
        sock.shutdown(socket.SHUT_WR)

    async def run() -> tuple[bytes, list]:
        budget, rejected = StreamBudget(PeerLimits(stream_idle_timeout_s=0.2)), []
        return await _serve(_echo([], []), budget, send, rejected), rejected

    received, rejected = asyncio.run(run())
    frames = _frames(received)
    assert runtime_pb2.ExpertResponse.FromString(frames[0][1]).metadata == b"p.0"
    assert len(rejected) == 1 and isinstance(rejected[0], StreamStalled)
    assert frames[-1][0] == P2P.ERROR_MARKER and "stream_idle_timeout" in RPCError.FromString(frames[-1][1]).message


class _Transport(asyncio.Transport):
    """Records whether the connection's reading is paused (nothing is written anywhere)."""

    def __init__(self) -> None:
        super().__init__()
        self.reading = True

    def pause_reading(self) -> None:
        self.reading = False

    def resume_reading(self) -> None:
        self.reading = True

    def is_reading(self) -> bool:
        return self.reading

    def is_closing(self) -> bool:
        return False

    def write(self, data) -> None:
        pass

    def writelines(self, list_of_data) -> None:
        pass


class _HoldingOrder:
    """A session waiting for the client's next request (its port delivering) that records what it is handed."""

    ended = False

    def __init__(self) -> None:
        self.seen: list[str] = []

    def client(self, request: runtime_pb2.ExpertRequest | None) -> None:
        self.seen.append("" if request is None else request.uid)

    def fail(self, error: BaseException) -> None:
        self.ended = True


def test_a_caller_that_does_not_read_its_replies_cannot_make_the_server_buffer_its_input() -> None:
    """While the caller takes no replies (a pushed step's reply filled the pipe as its next request was awaited), its
    requests wait, and so must its bytes: reading pauses once `2 * limit_bytes` wait unread, as it does between steps
    (the port's delivery callback, left armed, took every chunk and paused nothing: the server buffered whatever the
    caller sent)."""

    async def run() -> tuple[_Transport, FrameConnection, _HoldingOrder]:
        conn = FrameConnection(header_bytes=PeerFrames.header_bytes, parse_header=PeerFrames.parse_header)
        transport = _Transport()
        conn.connection_made(transport)
        port = PeerStreamPort(conn, PeerFrames(), sys.maxsize, lease=None, idle_s=None, timeline=None)
        order = _HoldingOrder()
        port.attach(order, None)  # type: ignore[arg-type]
        port.ready()  # nothing buffered: the next request is delivered when its bytes arrive
        conn.pause_writing()  # the caller stopped reading its replies
        for i in range(64):  # ~1 MiB of whole requests, none of which can be run now
            conn.data_received(_message(f"p.{i}", filler=16 * 1024))
        paused = not transport.is_reading()
        conn.resume_writing()  # the caller reads again: its first request is handed over
        assert paused, "the caller's input was buffered without bound while its replies waited"
        return transport, conn, order

    _, _, order = asyncio.run(run())
    assert order.seen == ["p.0"]


def test_a_caller_that_never_reads_does_not_keep_the_stream_open_after_it_ends(monkeypatch) -> None:
    """A stream whose caller takes none of its replies is closed (its socket released, what waited to go out dropped)
    within `CLOSE_FLUSH_S` of its end: a close that waits for the buffered replies to be read would hold the socket and
    the buffer for as long as the caller keeps its side open."""

    async def flood(requests, context, port) -> None:
        await requests.__anext__()
        for _ in range(8):  # more than the socket pair's buffers hold: the rest waits in the transport
            port.reply(runtime_pb2.ExpertResponse(metadata=b"\x00" * (1 << 20)))
        raise ValueError("bad step")

    monkeypatch.setattr(stream_endpoint, "CLOSE_FLUSH_S", 0.2)

    async def run() -> tuple[bool, bool]:
        loop = asyncio.get_running_loop()
        ours, theirs = socket.socketpair()
        theirs.setblocking(False)
        reader, writer = await asyncio.open_unix_connection(sock=ours)
        p2p = type("P2PStub", (), {"peer_id": "server"})()
        handle = stream_guard.steps_handler(
            p2p, "rpc_inference", flood, StreamBudget(PeerLimits()), on_reject=lambda name, e: None
        )
        await loop.sock_sendall(theirs, _message("p.0") + END)
        info = type("Info", (), {"peer_id": CLIENT_PEER})()
        await asyncio.wait_for(handle(info, reader, writer), BOUND_S)
        transport = writer.transport
        deadline = loop.time() + BOUND_S
        while transport.get_extra_info("socket").fileno() != -1 and loop.time() < deadline:
            await asyncio.sleep(0.1)
        released = transport.get_extra_info("socket").fileno() == -1
        theirs.close()
        return released, transport.is_closing()

    released, closing = asyncio.run(run())
    assert closing and released, "the stream's socket was held open by replies its caller never read"


def test_every_way_a_stream_ends_releases_its_socket_its_bytes_and_its_tasks() -> None:
    """hivemind's listener hands the connection over and forgets it: whichever way the stream ends (the caller's end,
    a close mid-message, a refused message, the session's error, a stall inside a header), its socket is closed, its
    charged bytes given back and no task is left behind."""

    async def refuse(requests, context, port) -> None:
        await requests.__anext__()
        raise ValueError("bad step")

    def sender(data: bytes, *, shut: bool = False):
        async def send(sock: socket.socket) -> None:
            await asyncio.get_running_loop().sock_sendall(sock, data)
            if shut:
                sock.shutdown(socket.SHUT_WR)

        return send

    endings = [
        (_echo([], []), sender(_message("p.0") + _message("p.1") + END)),
        (_echo([], []), sender(_message("p.0") + _message("p.1")[:-3], shut=True)),
        (_echo([], []), sender(_message("p.0") + _message("p.1", filler=500) + END)),
        (refuse, sender(_message("p.0") + _message("p.1") + END)),
        # (never ended by the caller: only the server's idle timeout ends it, however late this loop runs; an end
        # 0.5 s after the bytes, which a 0.3 s pause of the loop let come before the server's 0.2 s wait began, ended
        # it as a close mid-header)
        (_echo([], []), sender(_message("p.0") + _message("p.1")[:4])),
    ]

    async def run() -> tuple[list, int, int, list, int]:
        budget, rejected, transports = (
            StreamBudget(PeerLimits(max_stream_message_bytes=200, stream_idle_timeout_s=0.2)),
            [],
            [],
        )
        before = len(asyncio.all_tasks())
        for serve, send in endings * 3:
            await _serve(serve, budget, send, rejected, transports)
        await asyncio.sleep(0.05)  # (a closed transport lets go of its socket in the next loop turn)
        return (
            [t.get_extra_info("socket").fileno() for t in transports],
            before,
            len(asyncio.all_tasks()),
            rejected,
            budget.total_bytes,
        )

    fds, before, after, rejected, held = asyncio.run(run())
    assert fds == [-1] * len(endings) * 3 and after == before and held == 0
    assert [type(e) for e in rejected] == [PeerLimitExceeded, StreamStalled] * 3
