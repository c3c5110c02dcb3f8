"""Swarm keys, RPC membership proofs, the HMAC DHT authorizer and the per-session push guard (no network)."""

from __future__ import annotations

import asyncio
import os

import pytest
from hivemind.proto import dht_pb2

from corolla.protocol.auth import MEMBER_PROOF_KEY, UPSTREAM_PEER_KEY, MemberProof, join_info_uid, split_info_uid
from corolla.protocol.metadata import InferenceRequestMetadata
from corolla.server.core.push_guard import SessionPushGuard
from corolla.swarm.membership import MembershipError, RpcMembership, SwarmKey, SwarmKeyAuthorizer

A, B, C = "QmSenderAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA", "QmReceiverBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBB", "QmC"


def test_key_file_round_trip_and_refusals(tmp_path):
    key = SwarmKey.generate()
    path = key.save(tmp_path / "k")
    assert os.stat(path).st_mode & 0o077 == 0
    assert SwarmKey.load(path) == key and key.secret.hex() not in repr(key)
    with pytest.raises(FileExistsError):
        SwarmKey.generate().save(path)
    (tmp_path / "bad").write_text("not a key\n")
    with pytest.raises(ValueError, match="not a swarm key file"):
        SwarmKey.load(tmp_path / "bad")
    with pytest.raises(ValueError, match="32 bytes"):
        SwarmKey(b"short")
    assert key.dht_key != key.rpc_key != key.secret


def test_rpc_proof_is_bound_to_key_peers_and_time():
    key = SwarmKey.generate()
    members = RpcMembership(key, max_clock_skew_s=60)
    proof = members.make_proof(sender=A, receiver=B, now_s=1000.0)
    members.verify(proof, sender=A, receiver=B, now_s=1030.0)
    assert MemberProof.from_wire(proof.to_wire()) == proof and MemberProof.from_text(proof.to_text()) == proof
    for kwargs in (dict(sender=C, receiver=B), dict(sender=A, receiver=C), dict(sender=B, receiver=A)):
        with pytest.raises(MembershipError, match="not valid"):
            members.verify(proof, now_s=1000.0, **kwargs)
    with pytest.raises(MembershipError, match="stale"):
        members.verify(proof, sender=A, receiver=B, now_s=1061.0)
    with pytest.raises(MembershipError, match="stale"):
        members.verify(proof, sender=A, receiver=B, now_s=939.0)
    with pytest.raises(MembershipError, match="not valid"):
        RpcMembership(SwarmKey.generate()).verify(proof, sender=A, receiver=B, now_s=1000.0)
    with pytest.raises(MembershipError, match="no membership proof"):
        members.verify(None, sender=A, receiver=B)


@pytest.mark.parametrize(
    "wire", [None, 5, [1, 2], [2, 0, b"x" * 32], [1, -1, b"x" * 32], [1, True, b"x" * 32], [1, 0, b"x" * 31]]
)
def test_malformed_proofs_are_value_errors(wire):
    with pytest.raises(ValueError, match=MEMBER_PROOF_KEY):
        MemberProof.from_wire(wire)


def test_info_uid_carries_a_proof():
    proof = RpcMembership(SwarmKey.generate()).make_proof(sender=A, receiver=B)
    assert split_info_uid(join_info_uid("m.0 m.1", proof)) == ("m.0 m.1", proof.to_text())
    assert split_info_uid("m.0") == ("m.0", None)
    with pytest.raises(ValueError):
        MemberProof.from_text("1.2." + "zz" * 32)


def _signed_request(authorizer: SwarmKeyAuthorizer) -> dht_pb2.FindRequest:
    request = dht_pb2.FindRequest(keys=[b"k" * 20], peer=dht_pb2.NodeInfo(node_id=b"n" * 20))
    asyncio.run(authorizer.sign_request(request, None))
    return request


def test_dht_authorizer_accepts_members_only_once():
    key = SwarmKey.generate()
    client, service = SwarmKeyAuthorizer(key), SwarmKeyAuthorizer(key)
    request = _signed_request(client)
    assert asyncio.run(service.validate_request(request))
    assert not asyncio.run(service.validate_request(request)), "a replayed request must be refused"
    assert not asyncio.run(service.validate_request(_signed_request(SwarmKeyAuthorizer(SwarmKey.generate()))))
    assert not asyncio.run(service.validate_request(dht_pb2.FindRequest(keys=[b"k"])))  # unsigned (stock peer)
    tampered = _signed_request(client)
    tampered.keys[0] = b"x" * 20
    assert not asyncio.run(service.validate_request(tampered))
    stale = dht_pb2.FindRequest(keys=[b"k"])
    stale_auth = SwarmKeyAuthorizer(key, max_clock_skew_s=1)
    asyncio.run(stale_auth.sign_request(stale, None))
    stale.auth.time -= 120
    stale.auth.signature = b""
    stale.auth.signature = stale_auth._mac(b"request", stale.SerializeToString(deterministic=True))
    assert not asyncio.run(service.validate_request(stale))

    fresh = _signed_request(client)
    response = dht_pb2.FindResponse()
    asyncio.run(service.sign_response(response, fresh))
    assert asyncio.run(client.validate_response(response, fresh))
    assert not asyncio.run(client.validate_response(response, _signed_request(client)))  # another request's nonce
    forged = dht_pb2.FindResponse()
    asyncio.run(SwarmKeyAuthorizer(SwarmKey.generate()).sign_response(forged, fresh))
    assert not asyncio.run(client.validate_response(forged, fresh))


def _meta(**values) -> InferenceRequestMetadata:
    return InferenceRequestMetadata.from_dict(values)


def test_push_guard():
    guard = SessionPushGuard.from_open_request(_meta(session_id="s", **{UPSTREAM_PEER_KEY: A}))
    assert guard.accepts_push_from(A) and not guard.accepts_push_from(B) and not guard.accepts_push_from(None)
    assert not SessionPushGuard.from_open_request(_meta(session_id="s")).accepts_push_from(A)  # stock client
    with pytest.raises(ValueError, match=UPSTREAM_PEER_KEY):
        SessionPushGuard.from_open_request(_meta(**{UPSTREAM_PEER_KEY: "0OIl not base58"}))
    guard.observe_client_step(_meta(**{UPSTREAM_PEER_KEY: B}, next_servers=[[C, "next", 2, 4]]))
    assert guard.accepts_push_from(B) and not guard.accepts_push_from(A)
    assert guard.may_push_on(_meta(next_servers=[[A, "other", 2, 4]]))  # the client's own step: its own choice
    assert guard.may_push_on(_meta(pushed=True, next_servers=[[C, "next", 2, 4]]))
    assert not guard.may_push_on(_meta(pushed=True, next_servers=[[C, "victim", 2, 4]]))
    assert not guard.may_push_on(_meta(pushed=True))
