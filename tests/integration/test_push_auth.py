"""`rpc_push` is accepted only from the upstream peer the session's client named (`corolla.upstream_peer`), and a
pushed step is pushed on only to a hop the session's own client named. Raw RPCs from three peers (victim client,
attacker, declared upstream) to one in-process server (tiny Llama, blocks 0:4)."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest
import torch
from hivemind.compression.serialization import deserialize_torch_tensor

from corolla.protocol.auth import UPSTREAM_PEER_KEY
from corolla.protocol.forwarding import NEXT_STEP_KEY
from helpers.engine_reference import blocks_forward
from helpers.swarm import (
    ClientThread,
    InferenceStream,
    chain,
    connected_clients,
    packed_request,
    start_inprocess_server,
)
from helpers.tiny_models import HIDDEN_SIZE as HIDDEN

NUM_BLOCKS = 4

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def server(model_path, tmp_path_factory: pytest.TempPathFactory):
    server = start_inprocess_server(
        model_path,
        tmp_path_factory.mktemp("cache"),
        block_indices=(0, NUM_BLOCKS),
        step_timeout_s=10.0,
        session_timeout_s=60.0,
        request_timeout_s=20.0,
    )
    yield server
    server.shutdown()


@pytest.fixture(scope="module")
def peers(server):
    """Three independent libp2p identities: the victim's client, an attacker, the upstream the victim names."""
    with connected_clients(server, 3) as made:
        yield made


def push_from(pusher: ClientThread, server, request) -> None:
    pusher.run(lambda _stub: pusher.stub_for(server.peer_id).rpc_push(request, timeout=10))


def next_response(stream: InferenceStream, timeout_s: float):
    async def go(_stub):
        return await asyncio.wait_for(stream.responses.__anext__(), timeout_s)

    return stream.client.run(go, timeout_s=timeout_s + 5)


def open_victim(victim: ClientThread, server, session_id: str, **extra) -> InferenceStream:
    stream = InferenceStream(victim).open()
    empty = stream.step(
        packed_request(chain(server, 2, 4), torch.zeros(1, 0, HIDDEN), max_length=16, session_id=session_id, **extra)
    )
    assert deserialize_torch_tensor(empty.tensors[0]).shape == (1, 0, HIDDEN)
    return stream


def test_third_peer_cannot_push_into_a_session(server, peers, blocks):
    """The attack: a third peer that learned the session id pushes a step; the victim's next output must still be
    the honest one (today's code: the pushed step runs first and shifts the victim's cache: wrong output)."""
    victim, attacker, upstream = peers
    session_id = str(uuid.uuid4())
    stream = open_victim(victim, server, session_id, **{UPSTREAM_PEER_KEY: upstream.p2p.peer_id.to_base58()})

    garbage = torch.full((1, 3, HIDDEN), 5.0)
    push_from(attacker, server, packed_request(chain(server, 2, 4), garbage, session_id=session_id, step_id="evil"))
    # rpc_push returns once the step is queued: had it been accepted, it would run (and answer) before this one
    torch.manual_seed(0)
    honest = torch.randn(1, 2, HIDDEN)
    response = stream.step(packed_request(chain(server, 2, 4), honest, session_id=session_id, step_id="s1"))
    torch.testing.assert_close(
        deserialize_torch_tensor(response.tensors[0]), blocks_forward(blocks[2:4], honest), atol=1e-3, rtol=0
    )
    stream.close()


def test_declared_upstream_can_push_and_can_be_redeclared(server, peers, blocks):
    """A push from the declared upstream carrying the step id the client announced is served; a later direct step
    may name a new upstream (fail-over)."""
    victim, attacker, upstream = peers
    session_id = str(uuid.uuid4())
    stream = open_victim(victim, server, session_id, **{UPSTREAM_PEER_KEY: upstream.p2p.peer_id.to_base58()})
    torch.manual_seed(1)
    prefill = torch.randn(1, 2, HIDDEN)
    stream.step(
        packed_request(chain(server, 2, 4), prefill, session_id=session_id, step_id="d0", **{NEXT_STEP_KEY: "p1"})
    )
    first = torch.randn(1, 1, HIDDEN)
    push_from(
        upstream,
        server,
        packed_request(chain(server, 2, 4), first, session_id=session_id, step_id="p1", start_from_position=2),
    )
    pushed = next_response(stream, 10)
    expected = blocks_forward(blocks[2:4], torch.cat([prefill, first], dim=1))[:, 2:]
    torch.testing.assert_close(deserialize_torch_tensor(pushed.tensors[0]), expected, atol=1e-3, rtol=0)

    # the client moves its upstream to the "attacker" peer (now its honest new upstream); the old one is refused
    new_upstream = {UPSTREAM_PEER_KEY: attacker.p2p.peer_id.to_base58(), NEXT_STEP_KEY: "p3"}
    empty = stream.step(
        packed_request(chain(server, 2, 4), torch.zeros(1, 0, HIDDEN), session_id=session_id, **new_upstream)
    )
    assert deserialize_torch_tensor(empty.tensors[0]).shape == (1, 0, HIDDEN)
    second = torch.randn(1, 1, HIDDEN)
    stale = torch.full((1, 1, HIDDEN), 7.0)
    for pusher, tensor in ((upstream, stale), (attacker, second)):
        request = packed_request(
            chain(server, 2, 4), tensor, session_id=session_id, step_id="p3", start_from_position=3
        )
        push_from(pusher, server, request)
    pushed = next_response(stream, 10)
    expected = blocks_forward(blocks[2:4], torch.cat([prefill, first, second], dim=1))[:, 3:]
    torch.testing.assert_close(deserialize_torch_tensor(pushed.tensors[0]), expected, atol=1e-3, rtol=0)
    stream.close()


def test_declared_upstream_cannot_push_steps_the_client_did_not_announce(server, peers, blocks):
    """The declared upstream (a server the client trusts with its activations, not with its session) pushes a step
    id the client never announced, then the announced id with more tokens than any step of the client and with a
    rewind to 0: none runs (each would shift or overwrite the victim's cache: wrong output), the client's own step
    does."""
    victim, _, upstream = peers
    session_id = str(uuid.uuid4())
    stream = open_victim(victim, server, session_id, **{UPSTREAM_PEER_KEY: upstream.p2p.peer_id.to_base58()})
    torch.manual_seed(2)
    prefill = torch.randn(1, 2, HIDDEN)
    stream.step(
        packed_request(chain(server, 2, 4), prefill, session_id=session_id, step_id="d0", **{NEXT_STEP_KEY: "n1"})
    )
    uid = chain(server, 2, 4)
    for step_id, tensor, start in (("forged", torch.full((1, 1, HIDDEN), 5.0), 2), ("n1", torch.ones(1, 3, HIDDEN), 2)):
        push_from(
            upstream,
            server,
            packed_request(uid, tensor, session_id=session_id, step_id=step_id, start_from_position=start),
        )
    push_from(
        upstream,
        server,
        packed_request(uid, torch.ones(1, 1, HIDDEN), session_id=session_id, step_id="n1", start_from_position=0),
    )
    honest = torch.randn(1, 1, HIDDEN)
    response = stream.step(packed_request(uid, honest, session_id=session_id, step_id="n1", start_from_position=2))
    expected = blocks_forward(blocks[2:4], torch.cat([prefill, honest], dim=1))[:, 2:]
    torch.testing.assert_close(deserialize_torch_tensor(response.tensors[0]), expected, atol=1e-3, rtol=0)
    stream.close()


def test_session_without_declared_upstream_refuses_pushes(server, peers, blocks):
    """A stock Petals client names no upstream: no push is accepted (it sends every step directly anyway)."""
    victim, attacker, upstream = peers
    session_id = str(uuid.uuid4())
    stream = open_victim(victim, server, session_id)
    for pusher in (attacker, upstream):
        push_from(pusher, server, packed_request(chain(server, 2, 4), torch.ones(1, 1, HIDDEN), session_id=session_id))
    honest = torch.randn(1, 1, HIDDEN)
    response = stream.step(packed_request(chain(server, 2, 4), honest, session_id=session_id, step_id="d1"))
    torch.testing.assert_close(
        deserialize_torch_tensor(response.tensors[0]), blocks_forward(blocks[2:4], honest), atol=1e-3, rtol=0
    )
    stream.close()


def test_pushed_next_servers_cannot_redirect_into_other_sessions(server, peers, blocks):
    """A (legitimate) upstream of session A pushes a step whose `next_servers` names session B on this server, whose
    declared upstream is this server itself: the server must not push A's step into B (confused deputy)."""
    victim, attacker, _ = peers
    session_b = str(uuid.uuid4())
    stream_b = open_victim(victim, server, session_b, **{UPSTREAM_PEER_KEY: server.peer_id})
    session_a = str(uuid.uuid4())
    stream_a = InferenceStream(victim).open()
    stream_a.step(
        packed_request(
            chain(server, 0, 2), torch.zeros(1, 0, HIDDEN), max_length=16, session_id=session_a,
            **{UPSTREAM_PEER_KEY: attacker.p2p.peer_id.to_base58()},
        )
    )  # fmt: skip
    stream_a.step(
        packed_request(
            chain(server, 0, 2), torch.ones(1, 2, HIDDEN), session_id=session_a, step_id="a0", **{NEXT_STEP_KEY: "x"}
        )
    )  # the client announces step "x": its upstream may push that one
    evil = packed_request(
        chain(server, 0, 2), torch.full((1, 2, HIDDEN), 3.0), session_id=session_a, step_id="x",
        start_from_position=2, next_servers=[[server.peer_id, session_b, 2, 4]],
    )  # fmt: skip
    push_from(attacker, server, evil)
    next_response(stream_a, 10)  # session A ran the step its upstream pushed...
    time.sleep(0.5)  # ...and would have pushed it on into B by now
    honest = torch.randn(1, 1, HIDDEN)
    response = stream_b.step(packed_request(chain(server, 2, 4), honest, session_id=session_b, step_id="b1"))
    torch.testing.assert_close(
        deserialize_torch_tensor(response.tensors[0]), blocks_forward(blocks[2:4], honest), atol=1e-3, rtol=0
    )
    stream_a.close()
    stream_b.close()
