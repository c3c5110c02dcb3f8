"""Signed server records without a network: sign/verify, the peer-id binding, key binding, expiration and replay,
the DHT validator's decisions (as hivemind calls it), merging with unsigned records, and garbage never raising."""

from __future__ import annotations

import random
import time

import pytest
from hivemind.dht.routing import DHTID
from hivemind.dht.storage import DHTLocalStorage
from hivemind.dht.validation import DHTRecord
from hivemind.utils.serializer import MSGPackSerializer

from corolla.protocol.records import MAX_EXPIRATION_AHEAD_S, ModelInfo, RemoteModuleInfo, ServerInfo, ServerState
from corolla.swarm.identity import RecordSigner, peer_id_from_public_key
from corolla.swarm.signed_records import (
    RECENT_SIGNERS,
    VERIFY_CACHE,
    SignedRecordError,
    SignedRecordValidator,
    apply_signed_records,
    candidate_pairs,
    check_found_entry,
    key_id_bytes,
    sign_server_record,
    signed_record_key,
    verify_signed_entry,
    vote_model_info,
)

PREFIX = "tiny-test"
MODEL = ModelInfo(num_blocks=8, repository="local")


@pytest.fixture(scope="module")
def honest() -> RecordSigner:
    return RecordSigner.generate()


@pytest.fixture(scope="module")
def attacker() -> RecordSigner:
    return RecordSigner.generate()


def _info(state: ServerState = ServerState.ONLINE, start: int = 2, end: int = 6, **kwargs) -> ServerInfo:
    return ServerInfo(state=state, throughput=10.0, start_block=start, end_block=end, **kwargs)


def _dht_record(key: str, subkey: str, value, expiration_time: float) -> DHTRecord:
    """The record exactly as hivemind hands it to a validator (key id bytes, msgpack subkey and value)."""
    return DHTRecord(
        key_id_bytes(key), MSGPackSerializer.dumps(subkey), MSGPackSerializer.dumps(value), expiration_time
    )


def test_identity_peer_id_matches_libp2p(honest):
    from hivemind.p2p import PeerID

    assert PeerID.from_identity(honest.identity_bytes()).to_base58() == honest.peer_id
    assert peer_id_from_public_key(honest.public_key_bytes) == honest.peer_id
    assert RecordSigner.from_identity_bytes(honest.identity_bytes()).peer_id == honest.peer_id


def test_sign_and_verify_round_trip(honest):
    exp = time.time() + 60
    key, subkey, value = sign_server_record(honest, PREFIX, _info(), MODEL, exp)
    assert key == subkey == signed_record_key(PREFIX, honest.peer_id)
    record = verify_signed_entry(key_id_bytes(key), subkey, value, exp)
    assert record.peer_id == honest.peer_id and record.prefix == PREFIX
    assert record.server_info == _info() and record.model_info == MODEL and record.span == range(2, 6)
    assert SignedRecordValidator().validate(_dht_record(key, subkey, value, exp))


def test_a_signed_record_valid_far_ahead_is_refused_an_unsigned_one_left_to_readers(honest):
    validator = SignedRecordValidator()
    within, beyond = time.time() + MAX_EXPIRATION_AHEAD_S - 60, time.time() + MAX_EXPIRATION_AHEAD_S + 60
    for exp, valid in ((within, True), (beyond, False), (float("inf"), False), (float("nan"), False)):
        key, subkey, value = sign_server_record(honest, PREFIX, _info(), MODEL, exp)
        assert validator.validate(_dht_record(key, subkey, value, exp)) is valid
    # refusing an unsigned entry would drop its block's whole dictionary from a lookup (every server of the block):
    # readers skip it themselves (swarm.records_io)
    assert validator.validate(_dht_record("tiny-test.0", honest.peer_id, _info().to_tuple(), beyond))


def test_a_record_about_x_signed_by_someone_else_is_refused(honest, attacker):
    """The attacker cannot write under X's signed key: neither with its own key nor by reusing X's public key."""
    exp = time.time() + 600
    validator = SignedRecordValidator()
    x_key = signed_record_key(PREFIX, honest.peer_id)
    # 1. attacker signs an OFFLINE record with its own key and puts it under X's key/subkey
    _, _, forged = sign_server_record(attacker, PREFIX, _info(ServerState.OFFLINE), MODEL, exp)
    assert not validator.validate(_dht_record(x_key, x_key, forged, exp))
    with pytest.raises(SignedRecordError, match="does not hash"):
        verify_signed_entry(key_id_bytes(x_key), x_key, forged, exp)
    # 2. ... with X's public key in the envelope but the attacker's signature
    version, payload, _, signature = forged
    resigned = (version, payload, honest.public_key_bytes, signature)
    assert not validator.validate(_dht_record(x_key, x_key, resigned, exp))
    with pytest.raises(SignedRecordError, match="bad signature"):
        verify_signed_entry(key_id_bytes(x_key), x_key, resigned, exp)


def test_tampering_with_payload_expiration_or_key_is_refused(honest):
    exp = time.time() + 60
    key, subkey, value = sign_server_record(honest, PREFIX, _info(), MODEL, exp)
    validator = SignedRecordValidator()
    # a longer life than the owner signed
    assert not validator.validate(_dht_record(key, subkey, value, exp + 3600))
    # a changed payload (OFFLINE instead of ONLINE)
    payload = MSGPackSerializer.dumps(
        {"prefix": PREFIX, "server": _info(ServerState.OFFLINE).to_tuple(), "model": None}
    )
    assert not validator.validate(_dht_record(key, subkey, (1, payload, value[2], value[3]), exp))
    # X's genuine record moved under another model's key
    other = signed_record_key("other-model", honest.peer_id)
    with pytest.raises(SignedRecordError):
        verify_signed_entry(key_id_bytes(other), other, value, exp)
    assert not validator.validate(_dht_record(other, other, value, exp))


def test_replay_of_an_older_record_cannot_override_a_newer_one(honest):
    """hivemind keeps one value per (key, subkey), replaced only by a later expiration; the signature covers the
    expiration, so a replayed old record keeps its older expiration and loses; an expired one is refused."""
    now = time.time()
    key, subkey, old = sign_server_record(honest, PREFIX, _info(ServerState.OFFLINE), MODEL, now + 60)
    _, _, new = sign_server_record(honest, PREFIX, _info(ServerState.ONLINE), MODEL, now + 120)
    validator = SignedRecordValidator()
    assert validator.validate(_dht_record(key, subkey, old, now + 60))  # genuine, so valid on its own...
    storage = DHTLocalStorage()
    key_id = DHTID.generate(source=key)
    assert storage.store(key_id, MSGPackSerializer.dumps(new), now + 120, subkey=subkey)
    assert not storage.store(key_id, MSGPackSerializer.dumps(old), now + 60, subkey=subkey)  # ...but loses
    stored = storage.get(key_id).value.get(subkey)
    assert MSGPackSerializer.loads(stored.value) == new
    # expired records are refused by readers
    _, _, stale = sign_server_record(honest, PREFIX, _info(), MODEL, now - 1)

    class Found:
        def __init__(self, value, expiration_time):
            self.value = {key: type("E", (), {"value": value, "expiration_time": expiration_time})()}

    with pytest.raises(SignedRecordError, match="expired"):
        check_found_entry(key, Found(stale, now - 1))
    assert check_found_entry(key, Found(new, now + 120)).server_info.state == ServerState.ONLINE


def test_validator_leaves_other_records_alone_and_refuses_plain_values(honest):
    validator = SignedRecordValidator()
    exp = time.time() + 60
    # Petals' unsigned records, garbage included: not the validator's business (a refusal would drop whole dicts)
    assert validator.validate(_dht_record("tiny-test.0", honest.peer_id, _info().to_tuple(), exp))
    assert validator.validate(_dht_record("tiny-test.0", "garbage", b"\x00" * 10, exp))
    # a look-alike signed subkey under a block key is garbage for that key's readers, not a reason to drop the key
    look_alike = signed_record_key(PREFIX, honest.peer_id)
    assert validator.validate(_dht_record("tiny-test.0", look_alike, b"junk", exp))
    # plain values would replace whole dictionaries: refused
    plain = DHTRecord(key_id_bytes("_petals.models"), MSGPackSerializer.dumps(None), b"\x01", exp)
    assert not validator.validate(plain)


def test_garbage_under_a_signed_key_is_refused_never_raises(honest):
    rng = random.Random(0)
    exp = time.time() + 60
    key, subkey, value = sign_server_record(honest, PREFIX, _info(), MODEL, exp)
    good = MSGPackSerializer.dumps(value)
    validator = SignedRecordValidator()
    garbage = [b"", b"\xc1", b"\x92\x01", MSGPackSerializer.dumps((1, b"x", b"y", b"z")), b"\xd4\x40" * 500]
    for _ in range(300):  # mutations of a genuine record: flipped, cut and inserted bytes
        data = bytearray(good)
        for _ in range(rng.randint(1, 4)):
            pos = rng.randrange(len(data))
            op = rng.randrange(3)
            if op == 0:
                data[pos] ^= 1 << rng.randrange(8)
            elif op == 1:
                del data[pos : pos + rng.randint(1, 32)]
            else:
                data[pos:pos] = rng.randbytes(rng.randint(1, 16))
        garbage.append(bytes(data))
    for blob in garbage:
        result = validator.validate(DHTRecord(key_id_bytes(key), MSGPackSerializer.dumps(subkey), blob, exp))
        assert result is False or blob == good
    for value in (None, 7, "x", (1,), (2, b"", b"", b""), (1, "s", b"", b""), {"a": 1}):
        with pytest.raises(SignedRecordError):
            verify_signed_entry(key_id_bytes(key), subkey, value, exp)


def test_verification_is_cached_by_record_bytes(honest):
    VERIFY_CACHE.clear()
    exp = time.time() + 60
    key, subkey, value = sign_server_record(honest, PREFIX, _info(), MODEL, exp)
    for _ in range(5):
        verify_signed_entry(key_id_bytes(key), subkey, value, exp)
    assert VERIFY_CACHE.misses == 1 and VERIFY_CACHE.hits == 4


def test_signed_record_replaces_unsigned_records_of_its_peer(honest, attacker):
    exp = time.time() + 60
    x, stock = honest.peer_id, attacker.peer_id  # `stock`: a peer with no signed record (stock Petals server)
    _, _, value = sign_server_record(honest, PREFIX, _info(start=2, end=6), MODEL, exp)
    record = verify_signed_entry(key_id_bytes(signed_record_key(PREFIX, x)), signed_record_key(PREFIX, x), value, exp)
    forged_offline = _info(ServerState.OFFLINE, start=0, end=8)
    infos = [
        RemoteModuleInfo(uid=f"{PREFIX}.{i}", servers={x: forged_offline, stock: _info(start=0, end=8)})
        for i in range(8)
    ]
    merged = apply_signed_records(infos, {(PREFIX, x): record})
    for i, info in enumerate(merged):
        assert info.servers[stock] == _info(start=0, end=8)  # unsigned peers keep their records
        if 2 <= i < 6:
            assert info.servers[x].state == ServerState.ONLINE  # the forged OFFLINE is ignored
        else:
            assert x not in info.servers  # the signed span bounds what X serves
    # a signed peer appears even if its unsigned record is gone; adapters filter signed records too
    alone = apply_signed_records([RemoteModuleInfo(uid=f"{PREFIX}.3", servers={})], {(PREFIX, x): record})
    assert alone[0].servers[x].state == ServerState.ONLINE
    assert not apply_signed_records(alone, {(PREFIX, x): record}, active_adapter="lora")[0].servers


def test_vote_model_info(honest, attacker):
    exp = time.time() + 60
    records = []
    for signer, model in ((honest, MODEL), (honest, MODEL), (attacker, ModelInfo(num_blocks=2))):
        key, subkey, value = sign_server_record(signer, PREFIX, _info(start=0, end=2), model, exp)
        records.append(verify_signed_entry(key_id_bytes(key), subkey, value, exp))
    assert vote_model_info(records, PREFIX) == MODEL
    assert vote_model_info(records, "other") is None


def test_a_signer_verified_before_is_looked_up_first_past_a_flood():
    """The attack: 2,000 made-up subkeys under a block key ahead of a corolla server's pushed its signed record out of
    the reader's `max_lookups` (its unsigned record, which anyone may overwrite, then stood alone). A pair whose
    signed record verified lately is looked up first."""
    RECENT_SIGNERS.clear()
    raw = {"m.0": {**{f"QmJunk{i}": None for i in range(2000)}, "QmHonest": None}}
    pairs, skipped = candidate_pairs(["m.0"], raw, 1024)
    assert ("m", "QmHonest") not in pairs and skipped == 977  # a reader that never verified it
    RECENT_SIGNERS.put(("m", "QmHonest"), True)
    pairs, skipped = candidate_pairs(["m.0"], raw, 1024)
    assert pairs[0] == ("m", "QmHonest") and len(pairs) == 1024 and skipped == 977
    RECENT_SIGNERS.clear()
