"""A private swarm with a swarm key (`--swarm_key_file`): an outsider (no key, or a wrong one) can neither join the
DHT, read or write records members see, announce a server members use, nor call any RPC of a member server;
members generate the same tokens as local `transformers`. One in-process server (tiny Llama, all 4 blocks)."""

from __future__ import annotations

import time

import pytest
import torch
from hivemind.p2p import P2PHandlerError
from hivemind.proto import runtime_pb2

from corolla.health.collector import HealthConfig, StateCollector
from corolla.health.state import ModelEntry
from corolla.protocol.auth import MEMBER_PROOF_KEY, join_info_uid
from corolla.swarm.dht import SwarmConfig, create_dht, get_peer_id, shutdown_dht
from corolla.swarm.membership import RpcMembership, SwarmKey
from helpers.swarm import ClientThread, InferenceStream, chain, packed_request, start_inprocess_server
from helpers.tiny_models import HIDDEN_SIZE as HIDDEN

DHT_TIMEOUT_S = 10.0

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory):
    directory = tmp_path_factory.mktemp("keys")
    good, wrong = SwarmKey.generate(), SwarmKey.generate()
    return good, good.save(directory / "swarm.key"), wrong


@pytest.fixture(scope="module")
def server(model_path, keys, tmp_path_factory: pytest.TempPathFactory):
    server = start_inprocess_server(
        model_path, tmp_path_factory.mktemp("cache"), block_indices=(0, 4), swarm_key_file=str(keys[1])
    )
    yield server
    server.shutdown()


def uid(server, index: int) -> str:
    return f"{server.settings.dht_prefix}.{index}"


def test_outsider_cannot_join_the_dht(server, keys):
    """Bootstrapping from a member fails without the key and with a wrong key (every ping is refused)."""
    for key in (None, keys[2]):
        with pytest.raises((RuntimeError, TimeoutError)):
            dht = create_dht(
                SwarmConfig(initial_peers=server.join_maddrs, client_mode=True, startup_timeout_s=15, swarm_key=key)
            )
            shutdown_dht(dht)  # pragma: no cover - only reached if the outsider got in


def test_outsider_cannot_read_write_or_announce(server, keys):
    """An outsider that skips the bootstrap check reads nothing, and what it stores (a record, a fake server under
    a block's key) never reaches a member."""
    outsider = create_dht(
        SwarmConfig(
            initial_peers=server.join_maddrs,
            startup_timeout_s=15,
            swarm_key=keys[2],
            extra_dht_kwargs={"ensure_bootstrap_success": False},
        )
    )
    member = create_dht(SwarmConfig(initial_peers=server.join_maddrs, startup_timeout_s=15, swarm_key=keys[0]))
    try:
        outsider_id = get_peer_id(outsider).to_base58()
        block = uid(server, 0)
        # members see the server's announcement; the outsider sees nothing
        deadline = time.monotonic() + 20
        while member.get(block, latest=True) is None and time.monotonic() < deadline:
            time.sleep(0.5)
        announced = member.get(block, latest=True)
        assert announced is not None and server.peer_id in announced.value
        assert outsider.get(block, latest=True) is None
        # the outsider stores a plain record and a fake server entry; members never see them
        expiration = time.time() + 60
        outsider.store("outsider_record", subkey="x", value=b"hello", expiration_time=expiration)
        outsider.store(block, subkey=outsider_id, value=(2, 1000.0), expiration_time=expiration)
        time.sleep(1.0)
        assert member.get("outsider_record", latest=True) is None
        after = member.get(block, latest=True)
        assert after is not None and outsider_id not in after.value and server.peer_id in after.value
        # a member's own write is seen by other members (the test can tell the two apart)
        assert member.store("member_record", subkey="y", value=b"hi", expiration_time=expiration)
        assert server.dht.get("member_record", latest=True).value["y"].value == b"hi"
    finally:
        shutdown_dht(outsider)
        shutdown_dht(member)


def test_member_health_monitor_sees_its_servers_answer_pings(server, keys):
    """A member's health monitor signs its pings with the swarm key (members refuse unsigned ones): the server and
    the bootstrap peer are online on its page, not unreachable."""
    member = create_dht(
        SwarmConfig(initial_peers=server.join_maddrs, client_mode=True, startup_timeout_s=15, swarm_key=keys[0])
    )
    try:
        config = HealthConfig(use_models_index=False, initial_peers=tuple(server.join_maddrs))
        collector = StateCollector(member, [ModelEntry(dht_prefix=server.settings.dht_prefix, num_blocks=4)], config)
        deadline = time.monotonic() + 20
        while not (state := collector.refresh())["model_reports"][0]["server_rows"] and time.monotonic() < deadline:
            time.sleep(0.5)
        rows = state["model_reports"][0]["server_rows"]
        assert [(row["peer_id"], row["state"]) for row in rows] == [(server.peer_id, "online")], rows
        assert state["bootstrap_states"] == ["online"] * len(state["bootstrap_states"])
    finally:
        shutdown_dht(member)


def _call(client: ClientThread, fn) -> None:
    client.run(lambda stub: fn(stub), timeout_s=30)


def test_outsider_cannot_call_any_rpc(server, keys):
    """No proof, a wrong-key proof, or a member's proof made for another sender: every RPC is refused."""
    client = ClientThread(server.join_maddrs, server.peer_id)
    try:
        me = client.p2p.peer_id.to_base58()
        wrong = RpcMembership(SwarmKey(keys[2].secret)).make_proof(sender=me, receiver=server.peer_id).to_wire()
        stolen = RpcMembership(keys[0]).make_proof(sender=server.peer_id, receiver=server.peer_id).to_wire()
        hidden = torch.randn(1, 2, HIDDEN)
        for proof in (None, wrong, stolen):
            extra = {} if proof is None else {MEMBER_PROOF_KEY: proof}
            request = packed_request(chain(server, 0, 4), hidden, **extra)
            with pytest.raises(P2PHandlerError, match="membership"):
                _call(client, lambda stub, r=request: stub.rpc_forward(r, timeout=10))
            with pytest.raises(P2PHandlerError, match="membership"):
                _call(client, lambda stub, r=request: stub.rpc_backward(r, timeout=10))
            with pytest.raises(P2PHandlerError, match="membership"):
                _call(client, lambda stub, r=request: stub.rpc_push(r, timeout=10))
            with pytest.raises(P2PHandlerError, match="membership"):
                stream = InferenceStream(client).open()
                stream.step(packed_request(chain(server, 0, 4), hidden, max_length=8, **extra))
        with pytest.raises(P2PHandlerError, match="membership"):
            client.info(chain(server, 0, 4))
        with pytest.raises(P2PHandlerError, match="membership"):
            client.info("")
        # the same RPCs with a valid proof from this peer go through (so the refusals above are about the proof)
        membership = RpcMembership(keys[0])
        proof = membership.make_proof(sender=me, receiver=server.peer_id)
        response = client.run(
            lambda stub: stub.rpc_forward(
                packed_request(chain(server, 0, 4), hidden, **{MEMBER_PROOF_KEY: proof.to_wire()}), timeout=10
            )
        )
        assert len(response.tensors) == 1
        info = client.run(lambda stub: stub.rpc_info(runtime_pb2.ExpertUID(uid=join_info_uid("", proof)), timeout=10))
        assert info.serialized_info
    finally:
        client.close()


def test_member_generates_the_right_tokens(server, keys, model_path):
    """A member client (the key in its ClientConfig) generates exactly what local transformers does."""
    from transformers import AutoModelForCausalLM

    from corolla.client import AutoDistributedModelForCausalLM, ClientConfig

    reference = AutoModelForCausalLM.from_pretrained(model_path).eval()
    input_ids = torch.tensor([[1, 5, 9, 13, 2]])
    with torch.no_grad():
        expected = reference.generate(input_ids, max_new_tokens=6, do_sample=False)
    config = ClientConfig(initial_peers=tuple(server.join_maddrs), swarm_key_file=str(keys[1]), max_retries=2)
    with AutoDistributedModelForCausalLM.from_pretrained(
        model_path, client_config=config, torch_dtype=torch.float32
    ) as model:
        generated = model.generate(input_ids, max_new_tokens=6, do_sample=False)
        assert torch.equal(generated, expected)
        with torch.no_grad():
            logits = model(input_ids).logits  # forward path (rpc_forward) with proofs too
        torch.testing.assert_close(logits, reference(input_ids).logits, atol=1e-3, rtol=0)
