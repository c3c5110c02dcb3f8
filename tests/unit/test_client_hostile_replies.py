"""A client against servers whose replies are hostile in size or time (in-process fake servers, no network): a
draining server that claims a far deadline and trickles its KV export holds a step no longer than one response's
wait; a forward reply streamed without end, or an inference reply announcing far more bytes than its step's outputs,
is refused at the bytes the request implies (the server blamed), not read until the timeout."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time

import pytest
import torch
from hivemind.proto import runtime_pb2

from corolla.client.calls import remote_forward_backward
from corolla.client.calls.output_checks import BadServerOutput
from corolla.client.calls.remote_forward_backward import run_remote_forward
from corolla.client.config import ClientConfig
from corolla.client.routing.sequence_manager import RemoteSequenceManager
from corolla.client.session.inference_session import InferenceSession
from corolla.client.session.span_session import SpanSession
from corolla.client.transport.p2p_stream import P2PInferenceStream
from corolla.protocol import handoff as wire
from corolla.protocol.codecs import deserialize_tensor, serialize_tensor
from corolla.protocol.metadata import decode_metadata, encode_metadata
from corolla.protocol.records import RemoteSpanInfo, ServerInfo, ServerState
from corolla.protocol.stream_frames import FRAME_HEADER_BYTES, MESSAGE_MARKER, frame_header
from helpers.fake_chain import HIDDEN, FakeManager, FakeServer, reference
from helpers.fake_handoff import ExportWatch, Importer, PoisoningDrainer

TRICKLE_MESSAGES = 40
TRICKLE_GAP_S = 0.5  # inside request_timeout_s: each message on its own is on time


class DrainingTrickler(FakeServer):
    """Marks every answer draining with a deadline far in the future; asked for the session's cache, it announces
    `TRICKLE_MESSAGES` messages and sends one byte every `TRICKLE_GAP_S` (each response on time, the whole never)."""

    def __init__(self, start: int, end: int, inference_rps: float = 100.0):
        super().__init__(start, end, inference_rps)
        self.trickled = 0

    async def _serve(self, requests):
        watch = ExportWatch()

        far = encode_metadata({wire.DRAINING_KEY: wire.DrainNotice(1e9).to_dict()})
        async for response in super()._serve(watch.steps(requests)):
            yield runtime_pb2.ExpertResponse(tensors=response.tensors, metadata=far)
        if not watch.exporting:
            return
        metadata, tokens = self.requests[-1]
        header = wire.KvHeader(
            position=metadata["start_from_position"] + tokens, batch_size=1, start_block=self.start,
            end_block=self.end, num_messages=TRICKLE_MESSAGES, total_bytes=TRICKLE_MESSAGES * wire.MAX_MESSAGE_BYTES,
        )  # fmt: skip
        yield runtime_pb2.ExpertResponse(metadata=encode_metadata({wire.KV_HEADER_KEY: header.to_dict()}))
        for _ in range(TRICKLE_MESSAGES):
            await asyncio.sleep(TRICKLE_GAP_S)
            self.trickled += 1
            yield runtime_pb2.ExpertResponse(tensors=[runtime_pb2.Tensor(buffer=b"x")])


def test_a_forged_drain_deadline_holds_a_step_no_longer_than_one_response_wait():
    torch.manual_seed(0)
    # the trickler looks fastest, so the session starts on it; B holds the same blocks (a hand-off candidate)
    servers = {"trickler": DrainingTrickler(0, 2, inference_rps=1e6), "B": FakeServer(0, 2), "C": FakeServer(2, 4)}
    manager = FakeManager(
        servers, 4, request_timeout_s=1.0, connect_timeout_s=0.5, liveness_check_period_s=0, max_wait_s=10
    )
    tokens = torch.randn(1, 6, HIDDEN)
    with InferenceSession(manager, max_length=6) as session:
        started = time.monotonic()
        first = session.step(tokens[:, :4])  # its answer says "draining": the hand-off runs before step() returns
        took_s = time.monotonic() - started
        rest = [session.step(tokens[:, t : t + 1]) for t in range(4, 6)]
        records = session.handoffs.records
    # the hand-off's bound is the client's (request_timeout_s, at least MIN_HANDOFF_S, + connect_timeout_s): ~2.5 s
    # here; the server's claim of 1e9 s let it read all 40 trickled messages (20 s) before
    assert took_s < 10.0, f"the step took {took_s:.1f} s"
    assert servers["trickler"].trickled < TRICKLE_MESSAGES
    assert len(records) == 1 and records[0].to_peer is None and records[0].error is not None
    # the next step replays the history on the replacement: the outputs are still exact
    torch.testing.assert_close(torch.cat([first, *rest], dim=1), reference(tokens, 4), atol=1e-5, rtol=0)


class DrainingConfetti(DrainingTrickler):
    """Drains; asked for the session's cache, announces 2 messages of 8 MiB and sends 200,000 empty parts in the
    first: a few bytes each on the wire, a Python object each in the client (its export holds every part)."""

    async def _serve(self, requests):
        async for response in super()._serve(requests):
            if response.tensors or not response.metadata:
                yield response
                continue
            raw = decode_metadata(response.metadata).get(wire.KV_HEADER_KEY)
            if raw is None:
                yield response
                continue
            header = wire.KvHeader(**{**raw, "num_messages": 2, "total_bytes": 2 * wire.MAX_MESSAGE_BYTES})
            yield runtime_pb2.ExpertResponse(metadata=encode_metadata({wire.KV_HEADER_KEY: header.to_dict()}))
            for _ in range(2):
                self.trickled += 1
                yield runtime_pb2.ExpertResponse(tensors=[runtime_pb2.Tensor() for _ in range(200_000)])
            return


def test_a_kv_export_of_more_parts_than_its_header_allows_is_refused_at_the_first_message():
    torch.manual_seed(0)
    servers = {"confetti": DrainingConfetti(0, 2, inference_rps=1e6), "B": FakeServer(0, 2), "C": FakeServer(2, 4)}
    manager = FakeManager(servers, 4, request_timeout_s=30, liveness_check_period_s=0, max_wait_s=10)
    tokens = torch.randn(1, 5, HIDDEN)
    with InferenceSession(manager, max_length=5) as session:
        outputs = [session.step(tokens[:, :4]), session.step(tokens[:, 4:])]
        records = session.handoffs.records
    # 2 messages of 4 MiB over 4 tensors (2 blocks' K and V) hold at most 2 + 4 parts
    assert len(records) == 1 and records[0].to_peer is None and "parts" in str(records[0].error)
    assert servers["confetti"].trickled == 1  # the second message was never read
    torch.testing.assert_close(torch.cat(outputs, dim=1), reference(tokens, 4), atol=1e-5, rtol=0)


class Overflower(FakeServer):
    """From its second answer on, replies with its outputs in float32 times 1e6: finite on the wire, inf once the
    float16 client casts them back to its dtype (and then every later server's input)."""

    def __init__(self, start: int, end: int, inference_rps: float = 100.0):
        super().__init__(start, end, inference_rps)
        self.answers = 0

    async def _serve(self, requests):
        async for response in super()._serve(requests):
            self.answers += 1
            if self.answers > 1:
                outputs = deserialize_tensor(response.tensors[0]).float() * 1e6
                response = runtime_pb2.ExpertResponse(tensors=[serialize_tensor(outputs)])
            yield response


def _generate_fp16(manager, tokens):
    with InferenceSession(manager, max_length=tokens.shape[1]) as session:
        steps = [session.step(tokens[:, :4])] + [session.step(tokens[:, t : t + 1]) for t in range(4, tokens.shape[1])]
    return torch.cat(steps, dim=1)


def test_outputs_past_the_clients_dtype_fail_their_server_not_the_next_one():
    torch.manual_seed(0)
    tokens = torch.randn(1, 7, HIDDEN).half()
    expected = _generate_fp16(FakeManager({"A2": FakeServer(0, 2), "B": FakeServer(2, 4)}, 4), tokens)
    servers = {"liar": Overflower(0, 2, inference_rps=1e6), "A2": FakeServer(0, 2), "B": FakeServer(2, 4)}
    manager = FakeManager(servers, 4, max_wait_s=10)
    outputs = _generate_fp16(manager, tokens)
    assert servers["liar"].answers > 1 and manager.bans.is_banned("liar")
    assert not manager.bans.is_banned("B")  # before: B's outputs of the inf inputs were NaN, and B was banned
    torch.testing.assert_close(outputs, expected)


def _generate_8(manager, tokens):
    with InferenceSession(manager, max_length=8) as session:
        steps = [session.step(tokens[:, :4])] + [session.step(tokens[:, t : t + 1]) for t in range(4, 8)]
        return torch.cat(steps, dim=1), session.handoffs.records


def test_a_verifying_client_replays_a_drained_span_instead_of_taking_its_servers_cache():
    """A hand-off relays the draining server's cache unread: a poisoned one made the (honest) replacement answer
    wrong from then on, unchecked (a handed-off span session is never shadowed: its mirror would start mid-session;
    a sampled step check would blame the replacement). A client that verifies replays the span's history instead
    (the drainer's word for the cache is not taken); one that does not hands off as before (it takes every
    server's word anyway)."""
    torch.manual_seed(0)
    tokens = torch.randn(1, 8, HIDDEN)

    def swarm():
        return {"drainer": PoisoningDrainer(0, 2, inference_rps=1e6), "B": Importer(0, 2), "C": FakeServer(2, 4)}

    servers = swarm()
    outputs, records = _generate_8(FakeManager(servers, 4, max_wait_s=10, verify_shadow_fraction=1.0), tokens)
    torch.testing.assert_close(outputs, reference(tokens, 4), atol=1e-5, rtol=0)  # before: the noise's answers
    assert not records and servers["B"].imports == 0
    servers = swarm()
    _, records = _generate_8(FakeManager(servers, 4, max_wait_s=10), tokens)
    assert len(records) == 1 and records[0].to_peer == "B" and servers["B"].imports == 1


REPLY_PART_BYTES = 1 << 16
ENDLESS_PARTS = 256  # 16 MiB in all, 12x the reply the request implies


class EndlessForward(FakeServer):
    """Answers `rpc_forward_stream` with a tensor's first part and then parts without end (up to `ENDLESS_PARTS`,
    then silence): what the reply's bytes are is the server's choice, how many the client reads is the client's."""

    def __init__(self, start: int, end: int):
        super().__init__(start, end)
        self.parts_sent = 0

    async def rpc_forward_stream(self, requests):
        async def replies():
            async for _ in requests:
                pass
            first = serialize_tensor(torch.zeros(1, 1 << 20, HIDDEN))  # a declared [1, 1Mi, 8] fp32 tensor (32 MiB)
            first.buffer, first.chunks = first.buffer[:REPLY_PART_BYTES], 1 << 20
            yield runtime_pb2.ExpertResponse(tensors=[first])
            self.parts_sent += 1
            for _ in range(ENDLESS_PARTS - 1):
                yield runtime_pb2.ExpertResponse(tensors=[runtime_pb2.Tensor(buffer=bytes(REPLY_PART_BYTES))])
                self.parts_sent += 1
            await asyncio.sleep(3600)

        return replies()


def test_a_streamed_forward_reply_is_cut_at_the_bytes_its_request_implies():
    server = EndlessForward(0, 2)
    manager = FakeManager({"endless": server}, 2, request_timeout_s=30, direct_transport=False)
    inputs = torch.randn(1, 40_000, HIDDEN)  # 1.28 MB of fp32: past the unary limit, so both ways are streams
    span = manager.make_sequence(0, 2, mode="max_throughput")[0]
    started = time.monotonic()
    with pytest.raises(BadServerOutput, match="more than"):
        asyncio.run(asyncio.wait_for(run_remote_forward(manager, span, inputs, torch.empty(0)), 60))
    assert time.monotonic() - started < 20.0  # refused as the bytes came, not at request_timeout_s
    expected_parts = 4 * inputs.numel() // REPLY_PART_BYTES
    assert server.parts_sent <= expected_parts + 20, f"{server.parts_sent} parts were read"


PEER = "12D3KooWBNitLprcTBawSZBqZrrFMcka27mVwJcgm6LBUWMRXLq1"


@pytest.mark.parametrize("path", ["direct", "p2p"])
def test_a_forward_reply_message_is_refused_at_its_header(monkeypatch, path):
    """The attack: one reply message was read whole before its bytes were counted, at whatever length the server
    announced: over a direct port or local socket up to 1 GiB, over p2p without any bound (hivemind's stub reads
    the length an 8-byte header announces, `P2P.receive_raw_data`). A message announcing 64 MiB for a reply of at
    most 1.3 MB is now refused at its header (before: the client buffered what came and waited for the rest until
    request_timeout_s)."""
    manager = FakeManager({PEER: FakeServer(0, 2)}, 2, request_timeout_s=3.0, direct_transport=False)
    ours, theirs = socket.socketpair()
    ours.setblocking(False)
    stream = P2PInferenceStream(ours, PEER, "rpc_forward_stream")

    async def opened(*_args, **_kwargs):
        return stream

    async def no_socket(*_args, **_kwargs):
        return None

    if path == "direct":  # (the framing does not matter: each kind of stream checks its own headers)
        monkeypatch.setattr(remote_forward_backward, "open_socket_stream", opened)
        inputs = torch.randn(1, 4, HIDDEN)
    else:
        monkeypatch.setattr(remote_forward_backward, "open_socket_stream", no_socket)
        monkeypatch.setattr(manager, "open_inference_stream", opened)
        inputs = torch.randn(1, 40_000, HIDDEN)  # 1.28 MB of fp32: past the unary limit, a stream
    span = manager.make_sequence(0, 2, mode="max_throughput")[0]
    server = threading.Thread(target=_bloated_server, args=(theirs,))
    server.start()
    try:
        with pytest.raises(ConnectionError, match="exceeds the limit"):
            asyncio.run(asyncio.wait_for(run_remote_forward(manager, span, inputs, torch.empty(0)), 30))
        assert len(stream._buffer) < FRAME_HEADER_BYTES + (1 << 20)
    finally:
        stream.close()
        theirs.close()
        server.join(10)


ANNOUNCED_BYTES = 64 << 20  # under the stream's absolute bound (1 GiB), 4000x a one-token step's 16 KiB of outputs


def _session_over_a_socket(manager: RemoteSequenceManager) -> tuple[SpanSession, P2PInferenceStream, socket.socket]:
    """A started session of blocks 0:2 whose stream is one end of a socket pair: (it, its stream, the server's end)."""
    span = RemoteSpanInfo(PEER, 0, 2, ServerInfo(ServerState.ONLINE, 1.0, start_block=0, end_block=2))
    session = SpanSession(manager, span, max_length=64)
    ours, theirs = socket.socketpair()
    ours.setblocking(False)
    stream = P2PInferenceStream(ours, PEER)
    session._stream = session._direct = stream
    session.started = True
    return session, stream, theirs


def _bloated_server(sock: socket.socket) -> None:
    """Reads one request, then answers with a frame announcing `ANNOUNCED_BYTES` and sends 1 MiB of it."""
    header = sock.recv(FRAME_HEADER_BYTES, socket.MSG_WAITALL)
    length = int.from_bytes(header[1:], "big")
    while length > 0:
        length -= len(sock.recv(min(length, 1 << 16)))
    with contextlib.suppress(OSError):  # the client may close the stream before it is all sent
        sock.sendall(frame_header(MESSAGE_MARKER, ANNOUNCED_BYTES) + bytes(1 << 20))


@pytest.mark.parametrize("path", ["step_here", "step"])
def test_an_inference_reply_over_the_bytes_of_its_outputs_is_refused_at_its_header(path):
    manager = RemoteSequenceManager(
        ClientConfig(request_timeout_s=3.0, liveness_check_period_s=0), ["m.0", "m.1"], start_updates=False
    )
    manager._input_compressions[PEER] = runtime_pb2.CompressionType.NONE  # as after the first rpc_info
    session, stream, theirs = _session_over_a_socket(manager)
    hidden = torch.randn(1, 1, 4096)  # 16 KiB of fp32 outputs expected
    kwargs = dict(position=0, prompts=torch.empty(0), hypo_ids=torch.empty(0, dtype=torch.int64), step_id="s")
    server = threading.Thread(target=_bloated_server, args=(theirs,))
    server.start()
    try:
        with pytest.raises(ConnectionError, match="exceeds the limit"):  # not a TimeoutError after reading 1 MiB
            if path == "step_here":
                session.step_here(hidden, 0, **kwargs)
            else:
                asyncio.run(asyncio.wait_for(session.step(hidden, 0, **kwargs), 30))
        assert len(stream._buffer) < FRAME_HEADER_BYTES + (1 << 20)  # the payload was never buffered whole
    finally:
        server.join(10)
        stream.close()
        theirs.close()


def _bloated_farewell(sock: socket.socket) -> None:
    """Reads the client's end of the session, then sends a frame announcing `ANNOUNCED_BYTES` and 1 MiB of it."""
    sock.recv(1 << 16)
    with contextlib.suppress(OSError):
        sock.sendall(frame_header(MESSAGE_MARKER, ANNOUNCED_BYTES) + bytes(1 << 20))


def test_a_closing_sessions_last_messages_are_no_bigger_than_a_reply_without_outputs():
    manager = RemoteSequenceManager(ClientConfig(connect_timeout_s=2.0), ["m.0", "m.1"], start_updates=False)
    session, stream, theirs = _session_over_a_socket(manager)
    server = threading.Thread(target=_bloated_farewell, args=(theirs,))
    server.start()
    try:
        asyncio.run(session.close())  # never raises: the drain's error is logged
        assert stream.closed and len(stream._buffer) < 1 << 20  # refused at the header, not read for 2 s
    finally:
        server.join(10)
        theirs.close()


class MadeUp(FakeServer):
    """A server record with a made-up peer id: nothing answers a dial (or a ping) to it."""

    def __init__(self, start: int, end: int, inference_rps: float = 1e6):
        super().__init__(start, end, inference_rps)
        self.dialled = 0

    async def rpc_inference(self, requests):
        self.dialled += 1
        raise ConnectionError("no address for a made-up peer id")


def test_after_a_made_up_server_fails_routes_take_the_measured_honest_one(monkeypatch):
    """The attack: records of made-up servers (unsigned, any peer id, claiming 1e6 blocks/s) that this client has not
    pinged yet won the route over an honest server it had measured, one after the other as each failed and was
    banned (all 1,000 of 1,000 at 300 ms, decision 0137). Now the first failure of a server never measured makes the
    unmeasured ones count as unreachable until the view is measured again: one made-up server tried, then the honest
    one."""
    servers: dict = {"honest": FakeServer(0, 2, inference_rps=2.0)}  # slow: 1 s a token for its 2 blocks
    manager = FakeManager(servers, 2, max_backoff_s=0.05)  # its first refresh measured the honest server
    made_up = {f"made-up-{i}": MadeUp(0, 2) for i in range(20)}
    servers.update(made_up)
    monkeypatch.setattr(manager, "measure_rtts_s", lambda peer_ids: {})  # none of them answers a ping
    manager.update()
    assert manager.make_sequence(0, 2, mode="min_latency")[0].peer_id.startswith("made-up")  # the bait works
    tokens = torch.randn(1, 8, HIDDEN)
    outputs, _ = _generate_8(manager, tokens)
    assert torch.allclose(outputs, reference(tokens, 2), atol=1e-5)
    assert sum(server.dialled for server in made_up.values()) == 1
