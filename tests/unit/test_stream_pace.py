"""A message in flight has a minimum rate (`PeerLimits.min_stream_rate_kib_s` after `min_stream_rate_grace_s`), both
ways. In: a request trickled a byte at a time, each byte inside the idle timeout, is refused (`StreamTooSlow`) on
every front that reads one (p2p's forward streams, p2p's inference streams, the socket's and the direct port's
frames), and its charged bytes given back; a slow but steady one is read whole. Out: a forward/backward reply the
caller never takes is dropped (`ReplyStalled`, counted) and the stream let go, on p2p and on the socket front,
instead of holding the reply, the request's charged bytes and the stream's task for as long as the caller stays."""

from __future__ import annotations

import asyncio
import socket

import pytest
from hivemind.p2p import P2P, P2PContext, PeerID
from hivemind.proto import runtime_pb2
from hivemind.proto.p2pd_pb2 import RPCError
from tests.helpers.socket_session import read_frame

from corolla.protocol import local_stream as ls
from corolla.server.core.limits import KiB, MiB, PeerLimits, ReplyStalled, StreamStalled, StreamTooSlow
from corolla.server.core.peer_bytes import StreamBudget, StreamLease
from corolla.server.core.refusals import rejection_reason
from corolla.server.front import stream_endpoint, stream_guard
from corolla.server.front.stream_endpoint import FrameConnection, PlainFrames, serve_inference

CLIENT_PEER = PeerID(b"test-client")  # a peer id object, as p2pd reports a stream's peer
BOUND_S = 5.0
IDLE_S = 2.0  # the idle timeout: every trickled byte below comes well inside it
GAP_S = 0.05  # a trickle: one byte every 50 ms (20 B/s)
# a message may take 1 s + its bytes at 8 KiB/s (8 KiB: 2 s); a reply of 1 MiB at 1 MiB/s: 2 s
PACED = PeerLimits(stream_idle_timeout_s=IDLE_S, min_stream_rate_kib_s=8, min_stream_rate_grace_s=1.0)
REPLY_PACED = PeerLimits(stream_idle_timeout_s=IDLE_S, min_stream_rate_kib_s=1024, min_stream_rate_grace_s=1.0)


def _request(uid: str = "p.0", filler: int = 0) -> bytes:
    return runtime_pb2.ExpertRequest(uid=uid, metadata=b"\x00" * filler).SerializeToString()


def _peer_frame(body: bytes) -> bytes:
    return P2P.MESSAGE_MARKER + len(body).to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER) + body


END = P2P.ERROR_MARKER + (0).to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER)


async def _send(sock: socket.socket, data: bytes, *, trickle_from: int | None = None, rate_bps: float = 0) -> None:
    """Sends `data`: at once up to `trickle_from`, then a byte every GAP_S (or, with `rate_bps`, steadily at that rate
    in 1 KiB pieces)."""
    loop = asyncio.get_running_loop()
    start = len(data) if trickle_from is None else trickle_from
    await loop.sock_sendall(sock, data[:start])
    step = 1024 if rate_bps else 1
    for i in range(start, len(data), step):
        await asyncio.sleep(step / rate_bps if rate_bps else GAP_S)
        await loop.sock_sendall(sock, data[i : i + step])


async def _guarded(method, budget: StreamBudget, send, rejected: list):
    """Serves one p2p forward stream (`stream_guard.guarded_stream_handler`) of what `send(client_socket)` sends;
    returns (the client's socket, the server's transport) once the handler returned."""
    ours, theirs = socket.socketpair()
    theirs.setblocking(False)
    reader, writer = await asyncio.open_unix_connection(sock=ours)
    p2p = type("P2PStub", (), {"peer_id": "server"})()
    handle = stream_guard.guarded_stream_handler(
        p2p, "rpc_forward_stream", method, budget, on_reject=lambda name, e: rejected.append(e)
    )
    sending = asyncio.create_task(send(theirs))
    info = type("Info", (), {"peer_id": CLIENT_PEER})()
    try:
        await asyncio.wait_for(handle(info, reader, writer), BOUND_S)
    finally:
        sending.cancel()
    return theirs, writer.transport


async def _socket_forward(handler, budget: StreamBudget, send):
    """Serves one forward stream of `handler` over the socket's and the direct port's framing (`serve_inference` of a
    training rpc, paced by `budget`'s limits) of what `send(client_socket)` sends; returns (the client's socket, the
    server's connection) once it was served and closed."""
    loop = asyncio.get_running_loop()
    ours, theirs = socket.socketpair()
    theirs.setblocking(False)
    _, conn = await loop.connect_accepted_socket(FrameConnection, ours)
    sending = asyncio.create_task(send(theirs))
    context = P2PContext(handle_name="rpc_forward_stream", local_id=CLIENT_PEER, remote_id=CLIENT_PEER)
    serving = serve_inference(
        handler, conn, context, PlainFrames(), 2 * MiB, lease=StreamLease(budget, "peer"), idle_s=IDLE_S,
        pace=budget.limits.message_pace, rpc="rpc_forward_stream",
    )  # fmt: skip
    try:
        await asyncio.wait_for(serving, BOUND_S)
    finally:
        sending.cancel()
        conn.close()
    return theirs, conn


async def _socket_released(transport: asyncio.BaseTransport) -> bool:
    deadline = asyncio.get_running_loop().time() + BOUND_S
    while transport.get_extra_info("socket").fileno() != -1 and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.05)
    return transport.get_extra_info("socket").fileno() == -1


async def _gathered_then_big_replies(requests, context):
    """A forward stream: its request read whole, then four replies of 1 MiB (more than a socket pair holds)."""
    async for _ in requests:
        pass
    for _ in range(4):
        yield runtime_pb2.ExpertResponse(metadata=b"\x00" * MiB)


def test_a_p2p_forward_reply_the_caller_never_takes_is_dropped_and_the_stream_let_go(monkeypatch) -> None:
    """A caller that sends its request and never reads: each 1 MiB reply must be taken within 1 s + 1 s, else what
    waits to go out is dropped and the handler returns (it waited on `drain` for as long as the caller stayed). While
    the reply waits, the request's bytes stay charged to the peer (its unsent replies count against its budget)."""
    monkeypatch.setattr(stream_endpoint, "CLOSE_FLUSH_S", 0.2)
    rejected: list = []
    charged_while_replying: list[int] = []
    budget = StreamBudget(REPLY_PACED)

    async def replies(requests, context):
        async for _ in requests:
            pass
        for _ in range(4):
            charged_while_replying.append(budget.per_peer.get(CLIENT_PEER.to_base58(), 0))
            yield runtime_pb2.ExpertResponse(metadata=b"\x00" * MiB)

    async def send(sock: socket.socket) -> None:  # the request and its end, then never a read
        await asyncio.get_running_loop().sock_sendall(sock, _peer_frame(_request(filler=1000)) + END)

    async def run() -> bool:
        theirs, transport = await _guarded(replies, budget, send, rejected)
        released = await _socket_released(transport)
        theirs.close()
        return released

    released = asyncio.run(run())
    assert [type(e) for e in rejected] == [ReplyStalled] and rejection_reason(rejected[0]) == "reply_stalled"
    assert charged_while_replying and charged_while_replying[0] > 1000
    assert released, "the stream's socket was held by a reply its caller never took"
    assert budget.total_bytes == 0 and not budget.per_peer


class _Metrics:
    def __init__(self) -> None:
        self.reasons: list[str] = []

    def rejected(self, reason: str) -> None:
        self.reasons.append(reason)


class _TrainingHandler:
    """A front for `serve_inference`'s training rpcs: a forward stream answered with four 1 MiB replies."""

    max_stream_bytes = 1 << 20

    def __init__(self) -> None:
        self.metrics = _Metrics()

    def rpc_forward_stream(self, requests, context):
        return _gathered_then_big_replies(requests, context)


def test_a_socket_front_forward_reply_the_client_never_takes_is_dropped(monkeypatch) -> None:
    """The same on the socket's and the direct port's connections (`serve_inference` of a training rpc)."""
    monkeypatch.setattr(stream_endpoint, "CLOSE_FLUSH_S", 0.2)
    handler = _TrainingHandler()

    async def run() -> bool:
        request = b"".join(ls.frame(ls.MESSAGE, _request())) + b"".join(ls.frame(ls.END))
        theirs, conn = await _socket_forward(handler, StreamBudget(REPLY_PACED), lambda sock: _send(sock, request))
        assert conn.transport is not None
        released = await _socket_released(conn.transport)
        theirs.close()
        return released

    released = asyncio.run(run())
    assert handler.metrics.reasons == ["reply_stalled"]
    assert released


def test_a_p2p_forward_methods_error_is_cut_to_the_error_limit_as_an_inference_sessions_is() -> None:
    """A forward/backward method's error goes to the caller as an `RPCError` cut as every other error text
    (`ls.error_text`): a 1 MiB text (it may quote what the caller sent) is not sent whole, past a client's limit."""
    text = "é" * (ls.MAX_ERROR_BYTES * 8)  # (2-byte characters: the cut must not split one)

    async def failing(requests, context):
        async for _ in requests:
            pass
        raise ValueError(text)
        yield  # (an async generator, as the rpc methods are)

    async def run() -> bytes:
        loop = asyncio.get_running_loop()
        theirs, _ = await _guarded(
            failing, StreamBudget(PeerLimits()), lambda sock: _send(sock, _peer_frame(_request()) + END), []
        )
        received = b""
        while chunk := await asyncio.wait_for(loop.sock_recv(theirs, 1 << 20), BOUND_S):
            received += chunk
        theirs.close()
        return received

    received = asyncio.run(run())
    assert received[:1] == P2P.ERROR_MARKER
    body = received[1 + P2P.HEADER_LEN :]
    message = RPCError.FromString(body).message
    assert len(body) <= ls.MAX_ERROR_BYTES and message and text.startswith(message) and "\ufffd" not in message


# ---- requests trickled in ------------------------------------------------------------------------------------------


async def _echo_all(requests, context):
    async for request in requests:
        yield runtime_pb2.ExpertResponse(metadata=request.uid.encode())


def test_a_trickled_p2p_forward_request_is_refused_at_its_pace() -> None:
    """8 KiB declared, then a byte every 50 ms (each well inside the 2 s idle timeout): refused once 1 s + 8 KiB at
    8 KiB/s are over, its charged bytes given back; it was read for as long as the caller kept trickling."""
    rejected: list = []
    body = _request(filler=8 * KiB)

    async def run() -> tuple[bytes, StreamBudget, float]:
        loop = asyncio.get_running_loop()
        started = loop.time()
        budget = StreamBudget(PACED)
        theirs, _ = await _guarded(
            _echo_all, budget, lambda sock: _send(sock, _peer_frame(body) + END, trickle_from=64), rejected
        )
        elapsed = loop.time() - started
        received = await asyncio.wait_for(loop.sock_recv(theirs, 1 << 16), BOUND_S)
        theirs.close()
        return received, budget, elapsed

    received, budget, elapsed = asyncio.run(run())
    assert [type(e) for e in rejected] == [StreamTooSlow] and rejection_reason(rejected[0]) == "stream_too_slow"
    assert received[:1] == P2P.ERROR_MARKER and b"min_stream_rate_kib_s" in received
    assert budget.total_bytes == 0 and not budget.per_peer
    assert elapsed < BOUND_S


def test_a_slow_but_steady_p2p_forward_request_is_read_whole() -> None:
    """16 KiB at 32 KiB/s (4x the minimum rate; 3 s allowed): read and answered."""
    rejected: list = []
    body = _request(uid="p.7", filler=16 * KiB)

    async def run() -> bytes:
        loop = asyncio.get_running_loop()
        theirs, _ = await _guarded(
            _echo_all, StreamBudget(PACED), lambda sock: _send(sock, _peer_frame(body) + END, trickle_from=0, rate_bps=32 * KiB),
            rejected,
        )  # fmt: skip
        received = await asyncio.wait_for(loop.sock_recv(theirs, 1 << 16), BOUND_S)
        theirs.close()
        return received

    received = asyncio.run(run())
    assert rejected == [] and received[:1] == P2P.MESSAGE_MARKER and received.endswith(b"p.7")


async def _gathered(requests, context):
    """A forward stream as the handler's (`gather_stream`): its request's parts read whole, then one reply."""
    async for _ in requests:
        pass
    yield runtime_pb2.ExpertResponse(metadata=b"done")


def test_a_p2p_forward_request_split_into_small_parts_is_refused_at_its_pace() -> None:
    """A streamed request's parts, each whole at once and 0.25 s apart (inside the 2 s idle timeout and each part's
    own 1 s grace): ~200 B/s for the request, refused once 1 s + its bytes at 8 KiB/s are over (the parts share one
    clock from the stream's start), its charged bytes given back; a clock per part would read it for as long as the
    caller kept sending parts."""
    rejected: list = []
    part = _peer_frame(_request(filler=40))

    async def parts(sock: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        for _ in range(40):  # 10 s of parts, twice the bound
            await loop.sock_sendall(sock, part)
            await asyncio.sleep(0.25)
        await loop.sock_sendall(sock, END)

    async def run() -> tuple[bytes, StreamBudget]:
        loop = asyncio.get_running_loop()
        budget = StreamBudget(PACED)
        theirs, _ = await _guarded(_gathered, budget, parts, rejected)
        received = await asyncio.wait_for(loop.sock_recv(theirs, 1 << 16), BOUND_S)
        theirs.close()
        return received, budget

    received, budget = asyncio.run(run())
    assert [type(e) for e in rejected] == [StreamTooSlow]
    assert received[:1] == P2P.ERROR_MARKER and b"min_stream_rate_kib_s" in received
    assert budget.total_bytes == 0 and not budget.per_peer


class _GatheringHandler(_TrainingHandler):
    """A front whose forward stream gathers its request's parts, then answers once."""

    def rpc_forward_stream(self, requests, context):
        return _gathered(requests, context)


@pytest.mark.parametrize("nparts", [40, 0], ids=["small_parts", "none"])
def test_a_socket_front_forward_request_split_into_small_parts_is_refused_at_its_pace(nparts) -> None:
    """The same on the socket's and the direct port's connections (`serve_inference` of a training rpc): the frames
    of one request share one clock from the stream's start, so a stream that never starts its request is refused
    too (it was waited for with no bound at all)."""

    async def run() -> tuple[bytes, StreamBudget]:
        loop = asyncio.get_running_loop()
        part = b"".join(ls.frame(ls.MESSAGE, _request(filler=40)))

        async def parts(sock: socket.socket) -> None:
            for _ in range(nparts):  # 10 s of parts, twice the bound
                await loop.sock_sendall(sock, part)
                await asyncio.sleep(0.25)
            await asyncio.sleep(10)
            await loop.sock_sendall(sock, b"".join(ls.frame(ls.END)))

        budget = StreamBudget(PACED)
        theirs, _ = await _socket_forward(_GatheringHandler(), budget, parts)
        received = await asyncio.wait_for(loop.sock_recv(theirs, 1 << 16), BOUND_S)
        theirs.close()
        return received, budget

    received, budget = asyncio.run(run())
    assert b"min_stream_rate_kib_s" in received
    assert budget.total_bytes == 0 and not budget.per_peer


def test_a_socket_front_forward_requests_parts_stay_charged_until_the_stream_ends() -> None:
    """As on p2p (`guarded_stream_handler`): the request's parts, all held by the method (`gather_stream`), stay
    charged to the peer's stream budget while it runs and its reply waits, given back when the stream ends; each part
    released as the next was read, a peer's direct-port streams could hold their gathered requests outside its budget."""
    held: list[int] = []
    budget = StreamBudget(PACED)

    async def gathered(requests, context):
        async for _ in requests:
            pass
        held.append(budget.total_bytes)
        yield runtime_pb2.ExpertResponse(metadata=b"done")

    class Handler(_TrainingHandler):
        def rpc_forward_stream(self, requests, context):
            return gathered(requests, context)

    handler = Handler()
    part = _request(filler=1000)

    async def run() -> None:
        request = b"".join(ls.frame(ls.MESSAGE, part)) * 3 + b"".join(ls.frame(ls.END))
        theirs, _ = await _socket_forward(handler, budget, lambda sock: _send(sock, request))
        theirs.close()

    asyncio.run(run())
    assert held == [3 * len(part)]
    assert budget.total_bytes == 0 and not budget.per_peer


def test_a_slow_but_steady_request_in_many_parts_is_read_whole_on_both_fronts() -> None:
    """16 parts of 2 KiB sent steadily at 16 KiB/s (2x the minimum rate: the request's 5 s allowed, 2 s taken; past
    the 1 s grace, so the parts before count), on p2p and on the socket front: the shared clock refuses no honest
    part."""
    parts = [_request(uid="p.7", filler=2 * KiB) for _ in range(16)]

    async def steady(sock: socket.socket, frames: list[bytes], end: bytes) -> None:
        await _send(sock, b"".join(frames) + end, trickle_from=0, rate_bps=16 * KiB)

    async def p2p() -> bytes:
        loop = asyncio.get_running_loop()
        rejected: list = []
        theirs, _ = await _guarded(
            _gathered, StreamBudget(PACED), lambda sock: steady(sock, [_peer_frame(b) for b in parts], END), rejected
        )
        received = await asyncio.wait_for(loop.sock_recv(theirs, 1 << 16), BOUND_S)
        theirs.close()
        assert rejected == []
        return received

    async def socket_front() -> bytes:
        loop = asyncio.get_running_loop()
        frames = [b"".join(ls.frame(ls.MESSAGE, b)) for b in parts]
        theirs, _ = await _socket_forward(
            _GatheringHandler(), StreamBudget(PACED), lambda sock: steady(sock, frames, b"".join(ls.frame(ls.END)))
        )
        received = await asyncio.wait_for(loop.sock_recv(theirs, 1 << 16), BOUND_S)
        theirs.close()
        return received

    assert asyncio.run(p2p())[:1] == P2P.MESSAGE_MARKER
    received = asyncio.run(socket_front())
    assert b"done" in received and b"min_stream_rate" not in received


class _Order:
    """Stands in for a session's `StepOrder`: each request answered at once, the next one delivered by the port's
    data callback (`FrameConnection.deliver`: the path of a session's steps)."""

    ended = False

    def __init__(self, port, done: asyncio.Future, seen: list) -> None:
        self.port, self.done, self.seen = port, done, seen

    def client(self, request: runtime_pb2.ExpertRequest | None) -> None:
        if request is None:  # the end of the input (the caller's, or a refusal's)
            self.ended = True
            self.done.set_result(None)
            return
        self.seen.append(request.uid)
        self.port.reply(runtime_pb2.ExpertResponse(metadata=request.uid.encode()))
        self.port.ready()

    def fail(self, error: BaseException) -> None:
        self.ended = True
        self.done.set_exception(error)


def test_a_trickled_p2p_inference_step_is_refused_at_its_pace() -> None:
    """A p2p inference stream (`steps_handler`): the session's second message, delivered by callbacks, trickled."""
    rejected: list = []
    seen: list[str] = []

    async def serve(requests, context, port) -> None:
        first = await requests.__anext__()  # the session's opening request, read as a message
        done = asyncio.get_running_loop().create_future()
        order = _Order(port, done, seen)
        port.attach(order, requests)
        order.client(first)
        await done

    async def run() -> StreamBudget:
        ours, theirs = socket.socketpair()
        theirs.setblocking(False)
        reader, writer = await asyncio.open_unix_connection(sock=ours)
        budget = StreamBudget(PACED)
        p2p = type("P2PStub", (), {"peer_id": "server"})()
        handle = stream_guard.steps_handler(
            p2p, "rpc_inference", serve, budget, on_reject=lambda name, e: rejected.append(e)
        )
        data = _peer_frame(_request("p.0")) + _peer_frame(_request("p.1", filler=8 * KiB)) + END
        sending = asyncio.create_task(_send(theirs, data, trickle_from=len(_peer_frame(_request("p.0"))) + 64))
        info = type("Info", (), {"peer_id": CLIENT_PEER})()
        try:
            await asyncio.wait_for(handle(info, reader, writer), BOUND_S)
        finally:
            sending.cancel()
            theirs.close()
        return budget

    budget = asyncio.run(run())
    assert seen == ["p.0"] and [type(e) for e in rejected] == [StreamTooSlow]
    assert budget.total_bytes == 0


def _read_trickled(pieces_at_once: bytes, rest: bytes, *, rate_bps: float = 0):
    """`read_frame` on a socket front's connection (the socket's and the direct port's) under PACED."""

    async def go():
        ours, theirs = socket.socketpair()
        theirs.setblocking(False)
        _, conn = await asyncio.get_running_loop().connect_accepted_socket(FrameConnection, ours)
        data = pieces_at_once + rest
        feeding = asyncio.create_task(_send(theirs, data, trickle_from=len(pieces_at_once), rate_bps=rate_bps))
        lease = StreamLease(StreamBudget(PACED), "peer")
        try:
            return await asyncio.wait_for(
                read_frame(conn, 1 << 20, lease=lease, idle_s=IDLE_S, pace=PACED.message_pace),
                BOUND_S,
            )
        finally:
            feeding.cancel()
            lease.close()
            conn.close()
            theirs.close()

    return asyncio.run(go())


def test_a_trickled_socket_front_frame_is_refused_at_its_pace() -> None:
    frame = b"".join(ls.frame(ls.MESSAGE, b"x" * 8 * KiB))
    with pytest.raises(StreamTooSlow, match="min_stream_rate_kib_s=8"):
        _read_trickled(frame[:64], frame[64:])
    with pytest.raises(StreamTooSlow):  # its header trickled too: the same bound, from its first byte
        _read_trickled(b"", frame)


def test_a_slow_but_steady_socket_front_frame_is_read_whole() -> None:
    payload = bytes(range(256)) * 64  # 16 KiB at 32 KiB/s (4x the minimum rate; 3 s allowed)
    frame = b"".join(ls.frame(ls.MESSAGE, payload))
    assert _read_trickled(b"", frame, rate_bps=32 * KiB) == (ls.MESSAGE, payload, len(payload))


def test_the_pace_is_off_at_zero_and_stalls_still_end_a_stream() -> None:
    assert PeerLimits(min_stream_rate_kib_s=0).message_pace is None
    pace = PeerLimits().message_pace
    assert pace is not None and pace.allowed_s(0) == 10.0 and pace.allowed_s(4 * KiB) == 11.0
    assert issubclass(StreamTooSlow, StreamStalled) and issubclass(ReplyStalled, StreamStalled)
    with pytest.raises(ValueError, match="min_stream_rate_kib_s"):
        PeerLimits(min_stream_rate_kib_s=-1)
