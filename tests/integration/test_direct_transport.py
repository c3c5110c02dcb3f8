"""The direct inference stream (a server's TCP port, ticket over p2p, sealed frames): a corolla client uses it where
the server offers one and gets exactly what p2p gives; the ticket names the p2p-authenticated caller and that peer's
limits apply; a forged, expired or foreign ticket, a changed, replayed or wrongly keyed frame, and a peer past its
connection share are refused without a step running; a server with no direct port means p2p."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import uuid

import pytest
import torch
from hivemind.compression.serialization import deserialize_torch_tensor
from hivemind.proto import runtime_pb2
from hivemind.utils import MSGPackSerializer

from corolla.client import AutoDistributedModelForCausalLM, ClientConfig
from corolla.client.transport.direct_transport import DirectInferenceStream
from corolla.protocol import direct_stream as ds
from corolla.protocol import local_stream as ls
from corolla.protocol.rpc import handle_name
from corolla.server.core.limits import PeerLimits
from helpers.swarm import ClientThread, cache_used_bytes, chain, packed_request, start_inprocess_server, wait_until
from helpers.tiny_models import HIDDEN_SIZE as HIDDEN

NUM_BLOCKS = 4
PROMPT = torch.tensor([[1, 17, 42, 99, 7, 250, 31]])
MAX_SESSIONS_PER_PEER = 2

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def server(model_path, tmp_path_factory: pytest.TempPathFactory):
    server = start_inprocess_server(
        model_path,
        tmp_path_factory.mktemp("cache"),
        block_indices=(0, NUM_BLOCKS),
        direct_port=0,  # any free port on the loopback address the swarm listens on
        peer_limits=PeerLimits(
            max_sessions_per_peer=MAX_SESSIONS_PER_PEER, max_kv_fraction_per_peer=1.0, stream_idle_timeout_s=1.0
        ),
    )
    yield server
    server.shutdown()


def ticket_offer(client: ClientThread, server) -> ds.DirectOffer:
    async def go():
        call = client.p2p.call_protobuf_handler(
            client.peer_id, handle_name("rpc_direct_ticket"), runtime_pb2.ExpertUID(uid=""), runtime_pb2.ExpertInfo
        )
        response = await asyncio.wait_for(call, 10)
        return ds.DirectOffer.from_dict(MSGPackSerializer.loads(response.serialized_info))

    return client.call(go())


def step_request(server, hidden: torch.Tensor, session_id: str, position: int = 0) -> runtime_pb2.ExpertRequest:
    meta = dict(session_id=session_id, step_id=str(uuid.uuid4()), start_from_position=position)
    if position == 0:
        meta["max_length"] = 32
    dummies = (torch.empty(0), torch.empty(0, dtype=torch.int64))
    return packed_request(chain(server, 0, NUM_BLOCKS), hidden, *dummies, **meta)


def _run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


async def _connect(offer: ds.DirectOffer):
    return await asyncio.open_connection(offer.hosts[0], offer.port)


async def _hello(offer: ds.DirectOffer, peer_id: str, token: bytes | None = None, version: int | None = None):
    """A hand-driven connection's first exchange: (reader, writer, reply kind, reply payload, the hello's bytes)."""
    reader, writer = await _connect(offer)
    hello = ds.DirectHello("rpc_inference", peer_id, offer.ticket.token if token is None else token, os.urandom(16))
    raw = (hello if version is None else dataclasses.replace(hello, version=version)).to_bytes()
    writer.writelines(ls.frame(ls.HELLO, raw))
    kind, payload = await asyncio.wait_for(ls.read_frame(reader, 1 << 20), 10)
    return reader, writer, kind, payload, raw


async def _handshake(offer: ds.DirectOffer, peer_id: str):
    """A hand-driven connection through the whole handshake (the challenge answered with the ticket key's proof):
    (reader, writer, last reply kind, its payload, the connection's keys)."""
    reader, writer, kind, payload, raw = await _hello(offer, peer_id)
    assert kind == ls.ACCEPT, payload
    keys = ds.StreamKeys.derive(offer.ticket.key, raw, ds.parse_challenge(payload)[0])
    writer.writelines(ls.frame(ls.HELLO, keys.client_proof))
    kind, payload = await asyncio.wait_for(ls.read_frame(reader, 1 << 20), 10)
    return reader, writer, kind, payload, keys


def test_ticket_names_the_caller_and_offers_the_loopback_port(server, client):
    offer = ticket_offer(client, server)
    endpoint = server.service.direct_endpoint
    assert offer.hosts == ("127.0.0.1",) and offer.port == endpoint.port
    peer, key = endpoint.secret.check(offer.ticket.token)
    assert peer == client.p2p.peer_id.to_base58() and key == offer.ticket.key


def test_stream_gives_the_blocks_outputs_and_frees_the_cache(server, client, model_path):
    torch.manual_seed(0)
    prefix, token = torch.randn(1, 5, HIDDEN), torch.randn(1, 1, HIDDEN)
    offer = ticket_offer(client, server)

    async def go():
        stream = await DirectInferenceStream.open(offer, server.peer_id, timeout_s=5)
        assert stream is not None
        session = str(uuid.uuid4())
        outputs = []
        for request in (step_request(server, prefix, session), step_request(server, token, session, 5)):
            await stream.send(request)
            response = await asyncio.wait_for(stream.receive(), 30)
            outputs.append(deserialize_torch_tensor(response.tensors[0]))
        used = cache_used_bytes(server)
        await stream.send_end()
        assert await asyncio.wait_for(stream.receive(), 10) is None  # the server's END
        stream.close()
        return outputs, used

    outputs, used = _run(go())
    assert used > 0
    with torch.no_grad():
        whole = torch.cat([prefix, token], dim=1)
        for block in server_blocks(server, model_path):
            whole = block(whole)
    torch.testing.assert_close(outputs[0], whole[:, :5], atol=1e-4, rtol=0)
    torch.testing.assert_close(outputs[1], whole[:, 5:], atol=1e-4, rtol=0)
    assert wait_until(lambda: cache_used_bytes(server) == 0 and server.service.direct_endpoint.num_open == 0, 5)


def server_blocks(server, path):
    from corolla.models.loading import load_pretrained_block

    config = server.model_config
    return [load_pretrained_block(path, i, config=config, torch_dtype=torch.float32).eval() for i in range(NUM_BLOCKS)]


@pytest.mark.parametrize("busy_poll_ms, stale_ticket", [(0.0, False), (200.0, False), (0.0, True)])
def test_client_generates_the_same_tokens_over_the_direct_port(server, model_path, local, busy_poll_ms, stale_ticket):
    """...also when the client holds a ticket the server no longer knows (as after a server restart): it asks for
    a fresh one instead of leaving the server to p2p."""
    config = ClientConfig(local_transport=False, max_retries=0, busy_poll_ms=busy_poll_ms)
    opened = server.service.direct_endpoint.streams_opened
    with AutoDistributedModelForCausalLM.from_pretrained(
        model_path, initial_peers=server.join_maddrs, client_config=config
    ) as model:
        if stale_ticket:
            endpoint = server.service.direct_endpoint
            old = ds.TicketSecret().issue(model.manager._local_peer_id())  # another secret: refused by the server
            model.manager.direct_offers._offers[server.peer_id] = ds.DirectOffer(("127.0.0.1",), endpoint.port, old)
        with model.inference_session(max_length=32) as session:
            output = model.generate(PROMPT, max_new_tokens=12, do_sample=False, session=session)
            transports = {span.transport for span in session._spans}
            steps_here = session.num_steps_here
    with torch.no_grad():
        expected = local.generate(PROMPT, max_new_tokens=12, do_sample=False)
    assert output.tolist() == expected.tolist()
    assert transports == {"direct"} and server.service.direct_endpoint.streams_opened == opened + 1
    assert steps_here == 11  # every step after the prompt in this thread, as over the socket


def _forged(token: bytes) -> bytes:
    return token[:8] + bytes([token[8] ^ 1]) + token[9:]


@pytest.mark.parametrize("case", ["forged", "expired", "other_server", "garbage"])
def test_bad_tickets_are_refused_before_anything_runs(server, client, case):
    offer = ticket_offer(client, server)
    endpoint = server.service.direct_endpoint
    peer_id, token, expected = server.peer_id, offer.ticket.token, "not issued by this server"
    if case == "forged":
        token = _forged(token)  # e.g. another peer id or a later expiry: the MAC no longer matches
    elif case == "expired":
        token = endpoint.secret.issue(client.p2p.peer_id.to_base58(), ttl_s=-1).token
        expected = "expired"
    elif case == "other_server":
        peer_id, expected = "QmSomeOtherServer", "another peer id"
    else:
        token, expected = b"\x00" * 8, "at most"

    async def go():
        reader, writer, kind, payload, _ = await _hello(offer, peer_id, token)
        eof = await asyncio.wait_for(reader.read(), 10)
        writer.close()
        return kind, payload.decode(errors="replace"), eof

    refused, counted = endpoint.refused, _rejected(server, "direct_bad_hello")
    kind, message, eof = _run(go())
    assert kind == ls.ERROR and expected in message and eof == b""
    assert endpoint.refused == refused + 1 and _rejected(server, "direct_bad_hello") == counted + 1


def _rejected(server, reason: str) -> float:
    """`corolla_requests_rejected_total{reason=...}` in the server's metrics (0 before the first)."""
    prefix = f'corolla_requests_rejected_total{{reason="{reason}"}} '
    lines = [line for line in server.metrics.render().decode().splitlines() if line.startswith(prefix)]
    return float(lines[0].split()[-1]) if lines else 0.0


@pytest.mark.parametrize("attack", ["wrong_key", "tampered", "replayed"])
def test_frames_that_do_not_open_end_the_stream_without_a_step(server, client, attack):
    """After a good handshake, a frame sealed under another key, a sealed request with one flipped bit, or a frame
    sealed for an earlier connection does not open, and no step runs."""
    offer = ticket_offer(client, server)
    request = step_request(server, torch.randn(1, 3, HIDDEN), str(uuid.uuid4())).SerializeToString()
    executor = server.service.executor
    steps_before = executor.runtime.stats()

    async def go():
        reader, writer, kind, payload, keys = await _handshake(offer, server.peer_id)
        assert kind == ls.ACCEPT and payload == b""
        if attack == "wrong_key":
            frame = ds.Sealer(os.urandom(ds.KEY_BYTES)).seal(ls.MESSAGE, request)
        elif attack == "tampered":
            frame = bytearray(ds.Sealer(keys.client_to_server).seal(ls.MESSAGE, request))
            frame[40] ^= 1
            frame = bytes(frame)
        else:  # the bytes a client sealed for an earlier connection (its keys came from an older server nonce)
            hello = ds.DirectHello("rpc_inference", server.peer_id, offer.ticket.token, os.urandom(ds.NONCE_BYTES))
            old = ds.StreamKeys.derive(offer.ticket.key, hello.to_bytes(), os.urandom(ds.NONCE_BYTES))
            frame = ds.Sealer(old.client_to_server).seal(ls.MESSAGE, request)
        writer.write(frame)
        reply = await asyncio.wait_for(reader.read(), 10)  # the server answers with one sealed ERROR and hangs up
        writer.close()
        return reply, keys

    reply, keys = _run(go())
    kind, length = ls.parse_header(reply, 1 << 20)
    assert kind == ls.ERROR and len(reply) == ls.HEADER_BYTES + length
    assert b"failed authentication" in ds.Opener(keys.server_to_client).open(kind, reply[ls.HEADER_BYTES :])
    assert executor.runtime.stats() == steps_before  # nothing ran
    assert wait_until(lambda: cache_used_bytes(server) == 0, 5)


@pytest.mark.parametrize("attack", ["stalled", "oversized"])
def test_a_stalled_or_oversized_frame_ends_the_stream(server, client, attack):
    """A ticket holder that starts a frame and stops sending is cut off after stream_idle_timeout_s; one that
    declares a frame over the server's message limit is refused before a byte of it is buffered."""
    offer = ticket_offer(client, server)

    async def go():
        reader, writer, kind, _, keys = await _handshake(offer, server.peer_id)
        assert kind == ls.ACCEPT
        declared = 1000 if attack == "stalled" else (1 << 31)
        writer.write(ls.header(ls.MESSAGE, declared) + b"x" * 10)
        started = asyncio.get_running_loop().time()
        reply = await asyncio.wait_for(reader.read(), 10)
        writer.close()
        return reply, keys, asyncio.get_running_loop().time() - started

    reply, keys, waited_s = _run(go())
    kind, length = ls.parse_header(reply, 1 << 20)
    message = ds.Opener(keys.server_to_client).open(kind, reply[ls.HEADER_BYTES : ls.HEADER_BYTES + length])
    assert kind == ls.ERROR
    if attack == "stalled":
        assert b"sent nothing" in message and 0.9 < waited_s < 5
    else:
        assert b"exceeds" in message and waited_s < 1
    assert wait_until(lambda: server.service.direct_endpoint.num_open == 0, 10)


def test_a_peer_past_its_connection_share_is_refused(server, client):
    from corolla.server.front.direct_endpoint import SPARE_CONNECTIONS_PER_PEER

    offer = ticket_offer(client, server)
    share = MAX_SESSIONS_PER_PEER + SPARE_CONNECTIONS_PER_PEER

    async def go():
        held = []
        for _ in range(share):
            reader, writer, kind, _, _ = await _handshake(offer, server.peer_id)
            assert kind == ls.ACCEPT
            held.append(writer)
        _, writer, kind, payload, _ = await _handshake(offer, server.peer_id)
        writer.close()
        for w in held:
            w.close()
        return kind, payload.decode()

    counted = _rejected(server, "direct_connections")
    kind, message = _run(go())
    assert kind == ls.ERROR and f"already has {share} direct connections" in message
    assert _rejected(server, "direct_connections") == counted + 1
    assert wait_until(lambda: server.service.direct_endpoint.num_open == 0, 10)


async def _recorded_handshake(offer: ds.DirectOffer, peer_id: str) -> bytes:
    """Everything a real client sends while it opens a direct stream, as someone on the path sees it: the stream is
    opened (and closed) through a loopback relay that keeps the client's bytes."""
    sent = bytearray()

    async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, record: bool) -> None:
        while data := await reader.read(1 << 16):
            if record:
                sent.extend(data)
            writer.write(data)
        writer.close()

    async def relay(client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        server_reader, server_writer = await _connect(offer)
        await asyncio.gather(
            pipe(client_reader, server_writer, True), pipe(server_reader, client_writer, False), return_exceptions=True
        )

    relay_server = await asyncio.start_server(relay, "127.0.0.1", 0)
    relayed = dataclasses.replace(offer, port=relay_server.sockets[0].getsockname()[1])
    stream = await DirectInferenceStream.open(relayed, peer_id, timeout_s=10)
    assert stream is not None, "the direct port refused the ticket through the relay"
    stream.close()
    relay_server.close()
    return bytes(sent)


def test_a_replayed_hello_takes_none_of_the_victims_connections(server, client):
    """The token crosses the link in the clear: someone on the path who resends a client's recorded handshake (its
    hello alone, or all it sent) on as many connections as the client's connection share holds none of that share:
    the client's own streams still open, all of them, while the replays wait. (Version 1 accepted the resent hello
    and counted it against the ticket's peer until the step timeout, so the client fell back to p2p.)"""
    from corolla.server.front.direct_endpoint import SPARE_CONNECTIONS_PER_PEER

    offer = ticket_offer(client, server)
    endpoint = server.service.direct_endpoint
    share = MAX_SESSIONS_PER_PEER + SPARE_CONNECTIONS_PER_PEER

    async def go():
        recorded = await _recorded_handshake(offer, server.peer_id)
        kind, length = ls.parse_header(recorded, ls.MAX_HELLO_BYTES)
        hello_only = recorded[: ls.HEADER_BYTES + length]
        assert kind == ls.HELLO
        replays, answers, refusals = [], [], []
        for i in range(share):
            reader, writer = await _connect(offer)
            writer.write(hello_only if i % 2 else recorded)
            answers.append(await asyncio.wait_for(ls.read_frame(reader, 1 << 20), 10))
            if not i % 2:  # the recorded proof answers another server nonce
                refusals.append(await asyncio.wait_for(ls.read_frame(reader, 1 << 20), 10))
            replays.append(writer)
        streams = [await DirectInferenceStream.open(offer, server.peer_id, timeout_s=10) for _ in range(share)]
        opened = sum(stream is not None for stream in streams)
        for stream in streams:
            if stream is not None:
                stream.close()
        for writer in replays:
            writer.close()
        return answers, refusals, opened

    refused = _rejected(server, "direct_bad_proof")
    answers, refusals, opened = _run(go())
    assert opened == share, f"the client opened {opened} of its {share} direct connections beside the replays"
    assert all(kind == ls.ACCEPT and len(payload) == ds.NONCE_BYTES + ds.MAC_BYTES for kind, payload in answers)
    assert len({payload for _, payload in answers}) == share  # a fresh server nonce each time
    assert [kind for kind, _ in refusals] == [ls.ERROR] * (share // 2)
    assert all(b"did not prove" in payload for _, payload in refusals)
    assert _rejected(server, "direct_bad_proof") == refused + share // 2  # (the silent ones hung up before timing out)
    assert wait_until(lambda: endpoint.num_open == 0, 10)


def test_an_unanswered_challenge_ends_the_connection_within_the_hello_timeout(server, client, monkeypatch):
    """A resent hello that cannot answer the challenge holds its connection no longer than the handshake's bound
    (`HELLO_TIMEOUT_S` for the whole handshake, here 0.5 s), counted as `direct_bad_proof`."""
    from corolla.server.front import direct_endpoint

    monkeypatch.setattr(direct_endpoint, "HELLO_TIMEOUT_S", 0.5)
    offer = ticket_offer(client, server)

    async def go():
        reader, writer, kind, payload, _ = await _hello(offer, server.peer_id)
        eof = await asyncio.wait_for(reader.read(), 10)  # the server hangs up, saying nothing more
        writer.close()
        return kind, len(payload), eof

    refused = _rejected(server, "direct_bad_proof")
    assert _run(go()) == (ls.ACCEPT, ds.NONCE_BYTES + ds.MAC_BYTES, b"")
    assert _rejected(server, "direct_bad_proof") == refused + 1
    assert wait_until(lambda: server.service.direct_endpoint.num_open == 0, 10)


def test_a_version_1_hello_gets_an_error_at_once(server, client):
    """A client of the version before (which would also refuse this server's version-2 offer) is told so at its
    hello, and falls back to p2p instead of waiting."""
    offer = ticket_offer(client, server)
    assert offer.to_dict()["version"] == ds.DIRECT_STREAM_VERSION == 2

    async def go():
        reader, writer, kind, payload, _ = await _hello(offer, server.peer_id, version=1)
        eof = await asyncio.wait_for(reader.read(), 10)
        writer.close()
        return kind, payload.decode(errors="replace"), eof

    kind, message, eof = _run(go())
    assert kind == ls.ERROR and "version 1 is not 2" in message and eof == b""


def test_no_direct_port_means_p2p(model_path, local, tmp_path):
    quiet = start_inprocess_server(model_path, tmp_path / "cache", block_indices=(0, NUM_BLOCKS), local_socket=False)
    try:
        assert quiet.service.direct_endpoint is None
        config = ClientConfig(local_transport=False, max_retries=0)
        with AutoDistributedModelForCausalLM.from_pretrained(
            model_path, initial_peers=quiet.join_maddrs, client_config=config
        ) as model:
            with model.inference_session(max_length=32) as session:
                output = model.generate(PROMPT, max_new_tokens=4, do_sample=False, session=session)
                transports = {span.transport for span in session._spans}
            assert model.manager.direct_offers._none_until  # asked once, then p2p for a while
        with torch.no_grad():
            expected = local.generate(PROMPT, max_new_tokens=4, do_sample=False)
        assert output.tolist() == expected.tolist() and transports == {"p2p"}
    finally:
        quiet.shutdown()
