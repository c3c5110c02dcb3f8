"""Outputs past a float16 server's range in an inference session (decisions 0170, 0186), against in-process fakes:
a liar two spans before the float16 server, its values carried on by an honest span between, is found by asking
the spans before in turn (each replica agreeing with its span sends the question one span further up) and avoided
in the float16 server's place; the tokens are the reference's."""

from __future__ import annotations

import torch
from hivemind.proto import runtime_pb2

from corolla.client.session.inference_session import InferenceSession
from corolla.protocol.codecs import deserialize_tensor, serialize_tensor
from corolla.protocol.records import ServerInfo
from helpers.fake_chain import HIDDEN, FakeManager, FakeServer, Referee, record_of, reference, vouch


class HugeServer(Referee):
    """A hostile server announced fastest: 1e6 (legal in float32, past float16's range) in the first value of the
    last position of each step's outputs."""

    def __init__(self, start: int, end: int):
        super().__init__(start, end, inference_rps=1e6)

    async def rpc_inference(self, requests):
        return self._lie(self._serve(requests))

    async def _lie(self, responses):
        async for response in responses:
            outputs = deserialize_tensor(response.tensors[0]).clone()  # [B, T, H]
            outputs[:, -1, 0] = 1e6
            yield runtime_pb2.ExpertResponse(tensors=[serialize_tensor(outputs)])


class Float16Server(FakeServer):
    """Announces float16 (and the fastest figure): the client sends it nothing it cannot hold."""

    def __init__(self, start: int, end: int):
        super().__init__(start, end, inference_rps=1e6)

    def server_info(self) -> ServerInfo:
        info = record_of(self.start, self.end, self.inference_rps)
        info.torch_dtype = "float16"
        return info


def test_a_liar_two_spans_before_the_float16_server_is_avoided_in_its_place():
    """U (0:1) lies 1e6 into its outputs; M (1:2, honest) carries it on; the float16 server of 2:4 cannot take it.
    On main M's replica confirmed M, so the float16 server was routed around and U's value went on through the
    float32 server (outputs 1e6 off). Now U's replica is asked next, disputes U, and U is avoided instead: the
    session goes on through the float16 server, outputs the reference's."""
    torch.manual_seed(0)
    servers: dict[str, FakeServer] = {"U": HugeServer(0, 1), "A": Referee(0, 1)}
    servers.update({"M": Referee(1, 2), "M2": Referee(1, 2), "f16": Float16Server(2, 4), "B": FakeServer(2, 4)})
    manager = FakeManager(servers, 4, request_timeout_s=20.0)
    x = torch.randn(1, 6, HIDDEN)
    with InferenceSession(manager, max_length=6) as session:
        outputs = torch.cat([session.step(x[:, t : t + 1]) for t in range(x.shape[1])], dim=1)
        route = [s.peer_id for s, _ in session.route]
    torch.testing.assert_close(outputs, reference(x, 4))
    assert servers["U"].requests, "the liar was routed through first"
    assert "U" in manager.avoided_peers() and "f16" not in manager.avoided_peers()
    assert route[0] == "A" and route[-1] == "f16" and not manager.bans.banned_peers()


class VouchingReferee(Referee):
    """An attacker's second identity of the liar's blocks: as a replica (`rpc_forward`) it answers the liar's value
    too (1e6 in the first value of the last position), so it agrees with the liar's outputs."""

    def __init__(self, start: int, end: int):
        super().__init__(start, end, inference_rps=1.0)  # (never routed: it only referees)

    async def rpc_forward(self, request, timeout=None):
        outputs = deserialize_tensor((await super().rpc_forward(request, timeout)).tensors[0]).clone()
        outputs[:, -1, 0] = 1e6
        return runtime_pb2.ExpertResponse(tensors=[serialize_tensor(outputs)])


def test_a_liars_second_identity_among_the_replicas_does_not_get_its_value_used():
    """Decision 0228, against 0186 (0220's rule for race pairs). U (0:2) writes 1e6 into its outputs; the float16
    server of 2:4 cannot take it, so U's replicas are asked: A (honest) and W (the attacker's second identity, which
    answers U's value). Main asked them one by one and took the first that agreed with U (or U and W outvoting A,
    whichever was drawn first): "honest", the float16 server routed around and U's value went on through the float32
    server (outputs 1e6 off, every time). Now every replica is asked at once and U's outputs are the model's own only
    where all that answered agree: A and W split, U is avoided in the float16 server's place (nobody banned), and the
    outputs are the reference's."""
    torch.manual_seed(0)
    servers: dict[str, FakeServer] = {"U": HugeServer(0, 2), "A": Referee(0, 2), "W": VouchingReferee(0, 2)}
    servers.update({"f16": Float16Server(2, 4), "B": FakeServer(2, 4)})
    manager = FakeManager(servers, 4, request_timeout_s=20.0)
    x = torch.randn(1, 4, HIDDEN)
    with InferenceSession(manager, max_length=4) as session:
        outputs = torch.cat([session.step(x[:, t : t + 1]) for t in range(x.shape[1])], dim=1)
        route = [s.peer_id for s, _ in session.route]
    assert servers["U"].requests, "the liar was routed through first"
    torch.testing.assert_close(outputs, reference(x, 4))  # main: 1e6 off
    assert "U" in manager.avoided_peers() and "f16" not in manager.avoided_peers()
    assert route == ["A", "f16"] and not manager.bans.banned_peers()


def test_a_liars_range_dispute_asks_each_replica_once():
    """Decision 0232 (amplification, against 0228's replicas asked at once). U (0:2) writes 1e6 into its outputs;
    the float16 server of 2:4 cannot take it, so U's six honest replicas (each with a witness's standing, as with a
    client that verified them before) are asked at once, and all disagree. Main then put the first one's answer to
    `StretchReferees.decide`, which asked a second replica again, and the ban on their standing rechecked with the
    outsiders, the four others, asked again: 11 stateless forwards of the whole prefix where 6 answers were held, the
    honest replicas' work nearly doubled by each lie of each free identity. Now the answers already held decide: U
    is banned for good on the same answers, each replica asked once, the outputs the reference's."""
    torch.manual_seed(0)
    replicas = [f"R{i}" for i in range(6)]
    servers: dict[str, FakeServer] = {"U": HugeServer(0, 2), **{name: Referee(0, 2) for name in replicas}}
    servers.update({"f16": Float16Server(2, 4), "B": FakeServer(2, 4)})
    manager = FakeManager(servers, 4, request_timeout_s=20.0)
    vouch(manager, *replicas)
    x = torch.randn(1, 4, HIDDEN)
    with InferenceSession(manager, max_length=4) as session:
        outputs = torch.cat([session.step(x[:, t : t + 1]) for t in range(x.shape[1])], dim=1)
    assert servers["U"].requests, "the liar was routed through first"
    torch.testing.assert_close(outputs, reference(x, 4))
    assert manager.bans.banned_peers() == {"U"}
    assert [servers[name].forward_calls for name in replicas] == [1] * 6  # main: 11 calls, five replicas twice
