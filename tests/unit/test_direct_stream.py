"""Direct-stream pieces without a server: tickets (the MAC checked before anything in the token is believed,
expiry, layout), the hello's bounded parsing, sealed frames (a changed, repeated, reordered or wrongly keyed frame
does not open), the offer a hostile server could send (IP literals only, bounded; a host local to the client dialled
only where p2p reached the server there), and the client's offer cache."""

from __future__ import annotations

import asyncio
import os
import socket

import pytest
from hivemind.p2p import PeerID
from hivemind.p2p.p2p_daemon_bindings.datastructures import PeerInfo
from hivemind.proto import runtime_pb2
from hivemind.utils.multiaddr import Multiaddr

from corolla.client.calls.remote_forward_backward import open_socket_stream
from corolla.client.config import ClientConfig
from corolla.client.routing.sequence_manager import RemoteSequenceManager
from corolla.client.transport.direct_transport import (
    NO_DIRECT_RETRY_S,
    RENEW_BEFORE_EXPIRY_S,
    DirectOffers,
    connection_ips,
    dialable,
)
from corolla.protocol import direct_stream as ds
from corolla.protocol import local_stream as ls
from corolla.protocol.metadata import encode_metadata


def test_tickets_check_out_only_as_issued() -> None:
    secret = ds.TicketSecret()
    ticket = secret.issue("QmClient", now_s=1000.0, ttl_s=60)
    assert ticket.expires_at_s == 1060
    assert secret.check(ticket.token, now_s=1059.0) == ("QmClient", ticket.key)
    with pytest.raises(ValueError, match="expired"):
        secret.check(ticket.token, now_s=1061.0)
    for i in range(len(ticket.token)):  # any changed byte (peer id, expiry, nonce or MAC) is caught by the MAC
        changed = bytearray(ticket.token)
        changed[i] ^= 0x40
        with pytest.raises(ValueError, match="not issued by this server"):
            secret.check(bytes(changed), now_s=1000.0)
    with pytest.raises(ValueError, match="not issued by this server"):
        ds.TicketSecret().check(ticket.token, now_s=1000.0)  # another server's (or a restarted server's) secret
    for bad in (b"", b"\x01" * 10, b"\x01" * (ds.MAX_TOKEN_BYTES + 1)):
        with pytest.raises(ValueError, match="at most"):
            secret.check(bad)
    with pytest.raises(ValueError, match="peer id"):
        secret.issue("../etc")
    with pytest.raises(ValueError, match="32 bytes"):
        ds.TicketSecret(b"short")
    other = secret.issue("QmClient", now_s=1000.0)
    assert other.token != ticket.token and other.key != ticket.key  # a nonce per ticket


def test_hello_round_trip_and_malformed_hellos() -> None:
    hello = ds.DirectHello("rpc_inference", "QmServer", b"t" * 40, os.urandom(ds.NONCE_BYTES))
    raw = hello.to_bytes()
    assert ds.DirectHello.from_bytes(raw) == hello
    for bad in (b"", raw[:-1], raw + b"x", raw[:3], b"\x01\xff" + raw[2:], bytes([1, 2]) + b"\xff\xfe" + raw[4:]):
        with pytest.raises(ValueError):
            ds.DirectHello.from_bytes(bad)


def test_sealed_frames_open_once_in_order_under_their_key() -> None:
    keys = ds.StreamKeys.derive(os.urandom(32), os.urandom(80), os.urandom(16))
    sealer, opener = ds.Sealer(keys.client_to_server), ds.Opener(keys.client_to_server)
    frames = [sealer.seal(ls.MESSAGE, f"step {i}".encode()) for i in range(3)]

    def open_frame(op: ds.Opener, frame: bytes, kind: int | None = None) -> bytes:
        header_kind, length = ls.parse_header(frame, 1 << 20)
        assert length == len(frame) - ls.HEADER_BYTES
        return op.open(header_kind if kind is None else kind, frame[ls.HEADER_BYTES :])

    assert open_frame(opener, frames[0]) == b"step 0"
    with pytest.raises(ValueError, match="authentication"):
        open_frame(opener, frames[0])  # repeated
    with pytest.raises(ValueError, match="authentication"):
        open_frame(opener, frames[2])  # reordered (frame 1 skipped)
    with pytest.raises(ValueError, match="authentication"):
        open_frame(opener, frames[1], kind=ls.END)  # its header's kind changed
    assert open_frame(opener, frames[1]) == b"step 1"  # a refused frame does not advance the counter
    with pytest.raises(ValueError, match="authentication"):
        open_frame(ds.Opener(keys.server_to_client), frames[0])  # the other direction's key
    with pytest.raises(ValueError, match="shorter than its tag"):
        opener.open(ls.MESSAGE, b"x")


def test_stream_keys_bind_the_ticket_key_the_whole_hello_and_the_server_nonce() -> None:
    """Each of a connection's four secrets is its own (a proof says nothing of the other proof or of a key), and each
    changes with the ticket key, any byte of the hello (its client nonce, rpc, server peer id, token) or the server
    nonce: a proof recorded on one connection answers no other, and the client's proof cannot be made from the
    server's."""
    key, server_nonce = os.urandom(ds.KEY_BYTES), os.urandom(ds.NONCE_BYTES)
    hello = ds.DirectHello("rpc_inference", "QmServer", ds.TicketSecret().issue("QmClient").token, os.urandom(16))
    raw = hello.to_bytes()
    keys = ds.StreamKeys.derive(key, raw, server_nonce)
    secrets = (keys.client_to_server, keys.server_to_client, keys.server_proof, keys.client_proof)
    assert len(set(secrets)) == 4 and len(keys.client_proof) == len(keys.server_proof) == ds.MAC_BYTES
    assert ds.StreamKeys.derive(key, raw, server_nonce) == keys
    others = [ds.StreamKeys.derive(os.urandom(ds.KEY_BYTES), raw, server_nonce)]
    others.append(ds.StreamKeys.derive(key, raw, os.urandom(ds.NONCE_BYTES)))
    for i in range(len(raw)):
        changed = bytearray(raw)
        changed[i] ^= 1
        others.append(ds.StreamKeys.derive(key, bytes(changed), server_nonce))
    for other in others:
        assert not {other.client_to_server, other.server_to_client, other.server_proof, other.client_proof} & {*secrets}
    assert ds.parse_challenge(ds.challenge_payload(server_nonce, keys)) == (server_nonce, keys.server_proof)
    for bad in (b"", ds.challenge_payload(server_nonce, keys)[:-1], ds.challenge_payload(server_nonce, keys) + b"x"):
        with pytest.raises(ValueError, match="challenge"):
            ds.parse_challenge(bad)
    with pytest.raises(ValueError, match="server nonce"):
        ds.StreamKeys.derive(key, raw, b"short")
    assert ds.proof_matches(keys.client_proof, bytes(keys.client_proof))
    for bad in (b"", keys.client_proof[:-1], keys.client_proof + b"\0", keys.server_proof, bytes(ds.MAC_BYTES)):
        assert not ds.proof_matches(keys.client_proof, bad)


def _offer_dict(**changes: object) -> dict:
    offer = ds.DirectOffer(("127.0.0.1", "::1"), 4242, ds.TicketSecret().issue("QmClient"))
    return {**offer.to_dict(), **changes}


def test_offers_from_a_hostile_server_are_bounded() -> None:
    offer = ds.DirectOffer.from_dict(_offer_dict())
    assert offer.hosts == ("127.0.0.1", "::1") and offer.port == 4242
    for changes in (
        {"hosts": ["example.com"]},  # a name the client would have to resolve
        {"hosts": []},
        {"hosts": ["127.0.0.1"] * (ds.MAX_HOSTS + 1)},
        {"hosts": "127.0.0.1"},
        {"port": 0},
        {"port": 70000},
        {"port": "80"},
        {"token": b"x" * (ds.MAX_TOKEN_BYTES + 1)},
        {"key": b"k" * 31},
        {"expires_at": "soon"},
        {"version": 1},  # an offer of the version before the key was proved (a version-1 server's)
        {"version": 3},
    ):
        with pytest.raises(ValueError):
            ds.DirectOffer.from_dict(_offer_dict(**changes))
    with pytest.raises(ValueError):
        ds.DirectOffer.from_dict(["not", "a", "dict"])


@pytest.mark.parametrize(
    "hosts, p2p_ips, kept",
    [
        (["203.0.113.9", "10.1.2.3", "fd00::5"], [], ["203.0.113.9", "10.1.2.3", "fd00::5"]),  # other machines' IPs
        (["127.0.0.1", "::1"], ["127.0.0.1"], ["127.0.0.1"]),  # a loopback swarm: p2p reached it there
        (["127.0.0.1", "203.0.113.9"], ["203.0.113.9"], ["203.0.113.9"]),
        (["127.0.0.1"], ["203.0.113.9"], None),  # a remote server pointing the client at its own machine
        (["127.0.0.2"], ["127.0.0.1"], None),
        (["::ffff:127.0.0.1"], ["203.0.113.9"], None),
        (["0.0.0.0"], [], None),
        (["::"], [], None),
        (["169.254.169.254"], [], None),
        (["fe80::1"], [], None),
        (["224.0.0.1"], [], None),
        (["240.0.0.1"], [], None),
    ],
)
def test_an_offer_points_at_the_clients_own_machine_only_where_p2p_reached_the_server_there(hosts, p2p_ips, kept):
    offer = ds.DirectOffer.from_dict(_offer_dict(hosts=hosts))
    if kept is None:
        with pytest.raises(ValueError, match="local to the client"):
            dialable(offer, p2p_ips)
    else:
        assert list(dialable(offer, p2p_ips).hosts) == kept


class _HostileP2P:
    """A p2p whose server (reached at a public address) answers the ticket RPC with an offer of its choosing."""

    def __init__(self, offer: ds.DirectOffer, server: str):
        self.offer, self.server = offer, server

    async def call_protobuf_handler(self, peer, handle, request, response_type):
        return runtime_pb2.ExpertInfo(serialized_info=encode_metadata(self.offer.to_dict()))

    async def list_peers(self):
        return [PeerInfo(PeerID.from_base58(self.server), [Multiaddr("/ip4/198.51.100.7/tcp/31337")])]


def test_a_remote_servers_offer_of_a_port_on_the_clients_loopback_is_never_dialled() -> None:
    server = "12D3KooWBNitLprcTBawSZBqZrrFMcka27mVwJcgm6LBUWMRXLq1"
    victim = socket.create_server(("127.0.0.1", 0))  # a service of the client's machine (redis, memcached, ...)
    victim.settimeout(0.5)
    payload = b"\r\nFLUSHALL\r\n"  # what the server puts in its "token": the hello would carry it there
    secret_ticket = ds.Ticket(token=payload + bytes(20), key=bytes(ds.KEY_BYTES), expires_at_s=2**31 - 1)
    offer = ds.DirectOffer(("127.0.0.1",), victim.getsockname()[1], secret_ticket)
    config = ClientConfig(local_transport=False, direct_connect_timeout_s=0.5)
    manager = RemoteSequenceManager(config, ["m.0"], start_updates=False, p2p=_HostileP2P(offer, server))
    try:
        assert asyncio.run(open_socket_stream(manager, server, "rpc_inference")) is None
        with pytest.raises(TimeoutError):  # nothing connected, nothing was sent
            connection, _ = victim.accept()
            with connection:
                raise AssertionError(f"the client dialled the offered loopback port and sent {connection.recv(512)!r}")
    finally:
        victim.close()
    assert connection_ips([Multiaddr("/ip4/198.51.100.7/tcp/1"), Multiaddr("/ip6/::1/tcp/2/p2p/" + server)]) == {
        "198.51.100.7",
        "::1",
    }


def test_client_reuses_an_offer_until_near_expiry_and_backs_off_from_servers_without_one() -> None:
    now = [1000.0]
    asked: list[str] = []
    secret = ds.TicketSecret()

    async def ask(peer_id: str) -> ds.DirectOffer:
        asked.append(peer_id)
        if peer_id == "QmPetals":
            raise RuntimeError("handler not found")
        return ds.DirectOffer(("127.0.0.1",), 4242, secret.issue("QmMe", now_s=now[0], ttl_s=600))

    offers = DirectOffers(ask, time_fn=lambda: now[0])

    async def go() -> None:
        first = await offers.get("QmServer")
        assert first is not None and await offers.get("QmServer") is first
        now[0] += 600 - RENEW_BEFORE_EXPIRY_S + 1  # close to its expiry: a new ticket
        second = await offers.get("QmServer")
        assert second is not None and second is not first
        third = await offers.get("QmServer", fresh=True)  # asked again although the kept one is valid
        assert third is not None and third is not second and await offers.get("QmServer") is third
        assert await offers.get("QmPetals") is None and await offers.get("QmPetals") is None
        offers.unusable("QmServer")  # its port could not be reached
        assert await offers.get("QmServer") is None
        now[0] += NO_DIRECT_RETRY_S + 1
        assert await offers.get("QmPetals") is None and await offers.get("QmServer") is not None

    asyncio.run(go())
    assert asked == ["QmServer", "QmServer", "QmServer", "QmPetals", "QmPetals", "QmServer"]
