"""Server records that only their server can write. Beside Petals' unsigned `ServerInfo` under `<prefix>.<i>` (which
stock peers read as before), a corolla server stores one record about itself: key = subkey =
`_corolla.signed.<prefix>.<peer id>`, value = `(1, payload, public_key, signature)`, where payload holds its
`ServerInfo` (with its whole span) and `ModelInfo`, and the RSA-PSS signature (its libp2p identity key, whose hash is
the peer id) covers the key id, subkey, payload and expiration time. `SignedRecordValidator` refuses forged ones on
every corolla DHT node (stores and lookups); readers verify again (`verify_signed_entry`, cached by record bytes)
and `apply_signed_records` lets a peer's signed record replace every unsigned record about that peer."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import msgpack
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.utils.serializer import MSGPackSerializer

from corolla.protocol.bounded_msgpack import MsgpackLimits, is_number
from corolla.protocol.bounded_msgpack import loads as bounded_loads
from corolla.protocol.records import MAX_EXPIRATION_AHEAD_S, ModelInfo, RemoteModuleInfo, ServerInfo
from corolla.protocol.uids import parse_uid, validate_dht_prefix
from corolla.swarm.identity import RecordSigner, load_public_key, peer_id_from_public_key, verify_signature
from corolla.utils.logging import get_logger
from corolla.utils.lru import Lru

logger = get_logger(__name__)

SIGNED_KEY_PREFIX = "_corolla.signed"
RECORD_VERSION = 1
SIGNATURE_DOMAIN = b"corolla/signed-server-record/1"  # never valid as any other signed message
MAX_SIGNED_VALUE_BYTES = 8 * 1024  # envelope: ~300 B key + 256 B signature + ServerInfo (< 1 KiB)
MAX_SUBKEY_BYTES = 256
VERIFY_CACHE_ENTRIES = 4096  # verified (or refused) records remembered by their bytes: one RSA verify per record
PAYLOAD_LIMITS = MsgpackLimits(
    max_bytes=4 * 1024, max_depth=6, max_container_len=256, max_str_bytes=1024, max_bin_bytes=64, max_items=2048
)
ENVELOPE_LIMITS = MsgpackLimits(
    max_bytes=MAX_SIGNED_VALUE_BYTES, max_depth=2, max_container_len=8, max_str_bytes=64, max_bin_bytes=4096,
    max_items=16,
)  # fmt: skip
SUBKEY_LIMITS = MsgpackLimits(
    max_bytes=MAX_SUBKEY_BYTES + 3, max_depth=1, max_container_len=1, max_str_bytes=MAX_SUBKEY_BYTES, max_bin_bytes=1,
    max_items=1,
)  # fmt: skip
_PLAIN_VALUE_SUBKEY = MSGPackSerializer.dumps(None)  # hivemind's `DHTProtocol.IS_REGULAR_VALUE`


class SignedRecordError(ValueError):
    """A signed record that does not verify (bad shape, key, peer-id binding or signature)."""


def signed_record_key(prefix: str, peer_id: str) -> str:
    """The DHT key (and the subkey) of `peer_id`'s signed record for the model under `prefix`."""
    validate_dht_prefix(prefix)
    if not isinstance(peer_id, str) or not peer_id or "." in peer_id or " " in peer_id:
        raise ValueError(f"peer id must be a base58 str, got {peer_id!r:.80}")
    return f"{SIGNED_KEY_PREFIX}.{prefix}.{peer_id}"


def parse_signed_record_key(key: str) -> tuple[str, str]:
    """`"_corolla.signed.<prefix>.<peer>" -> (prefix, peer)`; ValueError otherwise."""
    parts = key.split(".") if isinstance(key, str) else []
    if len(parts) != 4 or ".".join(parts[:2]) != SIGNED_KEY_PREFIX:
        raise ValueError(f"not a signed record key: {key!r:.120}")
    return validate_dht_prefix(parts[2]), parts[3]


def key_id_bytes(key: str) -> bytes:
    """The DHT id hivemind stores `key` under (what validators see as `DHTRecord.key`)."""
    return DHTID.generate(source=key).to_bytes()


def _signed_message(key_id: bytes, subkey: str, payload: bytes, expiration_time: float) -> bytes:
    return msgpack.packb([SIGNATURE_DOMAIN, key_id, subkey, payload, float(expiration_time)], use_bin_type=True)


@dataclass(frozen=True)
class SignedServerRecord:
    """A verified record: `peer_id` wrote it (its key hashes to that id) about itself, for `prefix`'s blocks
    `[server_info.start_block, server_info.end_block)`, valid until `expiration_time`."""

    peer_id: str
    prefix: str
    server_info: ServerInfo
    model_info: ModelInfo | None
    expiration_time: float

    @property
    def span(self) -> range:
        start, end = self.server_info.start_block, self.server_info.end_block
        if start is None or end is None:  # only a record with both bounds is ever signed
            return range(0)
        return range(start, end)


def sign_server_record(
    signer: RecordSigner, prefix: str, server_info: ServerInfo, model_info: ModelInfo | None, expiration_time: float
) -> tuple[str, str, tuple[int, bytes, bytes, bytes]]:
    """`(key, subkey, value)` to store: `server_info` must carry its span (start_block < end_block)."""
    if server_info.start_block is None or server_info.end_block is None:
        raise ValueError("a signed server record needs server_info.start_block and end_block")
    key = signed_record_key(prefix, signer.peer_id)
    payload = MSGPackSerializer.dumps(
        {"prefix": prefix, "server": server_info.to_tuple(), "model": model_info.to_dict() if model_info else None}
    )
    if len(payload) > PAYLOAD_LIMITS.max_bytes:
        raise ValueError(f"signed record payload is {len(payload)} bytes, over {PAYLOAD_LIMITS.max_bytes}")
    signature = signer.sign(_signed_message(key_id_bytes(key), key, payload, expiration_time))
    return key, key, (RECORD_VERSION, payload, signer.public_key_bytes, signature)


# ---------------------------------------------------------------------------------------------- verification


# verification outcomes keyed by everything the signature covers (so a hit is the same record)
VERIFY_CACHE: Lru[tuple, SignedServerRecord | str] = Lru(VERIFY_CACHE_ENTRIES)


def verify_signed_entry(key_id: bytes, subkey: Any, value: Any, expiration_time: Any) -> SignedServerRecord:
    """Checks one entry as found in the DHT (value already msgpack-decoded) and returns what it says; raises
    SignedRecordError unless it is a well-formed record that the peer named in `subkey` signed for this key id,
    subkey and expiration time, with a public key that hashes to that peer id. Outcomes are cached."""
    if not isinstance(subkey, str) or len(subkey) > MAX_SUBKEY_BYTES:
        raise SignedRecordError("signed record subkey must be a short str")
    if not isinstance(value, (tuple, list)) or len(value) != 4:
        raise SignedRecordError("signed record must be (version, payload, public_key, signature)")
    version, payload, public_key, signature = value
    if version != RECORD_VERSION or not all(isinstance(x, bytes) for x in (payload, public_key, signature)):
        raise SignedRecordError(f"signed record must be version {RECORD_VERSION} with three bytes fields")
    if not is_number(expiration_time):
        raise SignedRecordError("signed record expiration time must be a number")
    cache_key = (key_id, subkey, payload, public_key, signature, float(expiration_time))
    outcome = VERIFY_CACHE.get(cache_key)
    if outcome is None:
        try:
            outcome = _verify_uncached(key_id, subkey, payload, public_key, signature, float(expiration_time))
        except SignedRecordError as e:
            outcome = str(e)
        VERIFY_CACHE.put(cache_key, outcome)
    if isinstance(outcome, str):
        raise SignedRecordError(outcome)
    return outcome


def _verify_uncached(
    key_id: bytes, subkey: str, payload: bytes, public_key: bytes, signature: bytes, expiration_time: float
) -> SignedServerRecord:
    try:
        prefix, peer_id = parse_signed_record_key(subkey)
    except ValueError as e:
        raise SignedRecordError(str(e)) from None
    if key_id != key_id_bytes(subkey):
        raise SignedRecordError("signed record is not stored under its own key")
    if peer_id_from_public_key(public_key) != peer_id:
        raise SignedRecordError(f"public key does not hash to peer id {peer_id}")
    try:
        key = load_public_key(public_key)
    except ValueError as e:
        raise SignedRecordError(str(e)) from None
    if not verify_signature(key, _signed_message(key_id, subkey, payload, expiration_time), signature):
        raise SignedRecordError(f"bad signature on the record of {peer_id}")
    try:
        body = bounded_loads(payload, PAYLOAD_LIMITS)
        if not isinstance(body, dict) or body.get("prefix") != prefix:
            raise ValueError("payload must be a dict naming the record key's prefix")
        server_info = ServerInfo.from_tuple(body.get("server"))
        model = body.get("model")
        model_info = None if model is None else ModelInfo.from_dict(model)
    except (TypeError, ValueError) as e:  # signed by the owner, but malformed: still worthless
        raise SignedRecordError(f"signed record of {peer_id} has a malformed payload: {e}") from None
    if server_info.start_block is None or server_info.end_block is None:
        raise SignedRecordError(f"signed record of {peer_id} does not name its span")
    if model_info is not None and server_info.end_block > model_info.num_blocks:
        raise SignedRecordError(
            f"signed record of {peer_id}: span ends past the model's {model_info.num_blocks} blocks"
        )
    return SignedServerRecord(peer_id, prefix, server_info, model_info, expiration_time)


class SignedRecordValidator(RecordValidatorBase):
    """Installed on every corolla DHT node (`create_dht`): a record whose subkey is a signed record key and that is
    stored under that key must verify and expire within `MAX_EXPIRATION_AHEAD_S`, else the node neither stores it nor
    accepts it from a lookup. Every other record passes untouched (Petals' unsigned ones included: a refusal drops the
    whole dictionary of a lookup's answer, every server of a block; readers skip a far-future one themselves,
    `records_io`), except plain (non-dictionary) values: neither Petals nor corolla stores any, and one with a later
    expiration would replace a whole dictionary (every server of a block, or the whole `_petals.models` index) at a
    node that accepts it."""

    def validate(self, record: DHTRecord) -> bool:
        if record.subkey == _PLAIN_VALUE_SUBKEY:
            return False
        if len(record.subkey) > MAX_SUBKEY_BYTES + 3 or SIGNED_KEY_PREFIX.encode() not in record.subkey:
            return True
        try:
            subkey = bounded_loads(record.subkey, SUBKEY_LIMITS)
        except ValueError:
            return True  # not a str subkey: not ours
        if not isinstance(subkey, str) or not subkey.startswith(SIGNED_KEY_PREFIX + "."):
            return True
        if record.key != key_id_bytes(subkey):
            return True  # a look-alike subkey under some other key: readers of that key skip it as garbage
        try:
            if len(record.value) > MAX_SIGNED_VALUE_BYTES:
                raise SignedRecordError(f"signed record is over {MAX_SIGNED_VALUE_BYTES} bytes")
            if not record.expiration_time <= time.time() + MAX_EXPIRATION_AHEAD_S:
                raise SignedRecordError(f"signed record expires more than {MAX_EXPIRATION_AHEAD_S:.0f} s ahead")
            value = bounded_loads(record.value, ENVELOPE_LIMITS)
            verify_signed_entry(record.key, subkey, value, record.expiration_time)
            return True
        except ValueError as e:
            logger.debug(f"signed_records.refused(subkey={subkey[:80]!r}): {e}")
            return False

    @property
    def priority(self) -> int:
        return 5

    def merge_with(self, other: RecordValidatorBase) -> bool:
        return isinstance(other, SignedRecordValidator)  # one is enough


def default_record_validators() -> list[RecordValidatorBase]:
    return [SignedRecordValidator()]


# ---------------------------------------------------------------------------------------------- reading


# what one read found: verified records by `(prefix, peer)`
SignedRecords = dict[tuple[str, str], SignedServerRecord]


# `(prefix, peer)` pairs whose signed record verified lately: their lookups go first, so that made-up subkeys flooding
# a block key past `max_lookups` do not push a known corolla server's signed record out of a read (its unsigned
# record, which anyone can overwrite, would then stand alone)
RECENT_SIGNERS_ENTRIES = 4096
RECENT_SIGNERS: Lru[tuple[str, str], bool] = Lru(RECENT_SIGNERS_ENTRIES)


def candidate_pairs(uids: Iterable[str], raw: Mapping[str, Any], max_lookups: int) -> tuple[list[tuple[str, str]], int]:
    """`(prefix, peer)` pairs worth a signed lookup: every str subkey under the requested block keys, each once,
    at most `max_lookups`, those in `RECENT_SIGNERS` first (the rest are counted, not looked up: their unsigned records
    are used as they are)."""
    pairs: dict[tuple[str, str], None] = {}
    for uid in uids:
        entries = raw.get(uid)
        if not isinstance(entries, Mapping):
            continue
        try:
            prefix, _ = parse_uid(uid)
        except ValueError:
            continue
        for subkey in entries:
            if isinstance(subkey, str) and 0 < len(subkey) <= 128 and "." not in subkey and " " not in subkey:
                pairs[(prefix, subkey)] = None
    chosen = sorted(pairs, key=lambda pair: pair not in RECENT_SIGNERS)  # (stable: otherwise in the order found)
    return chosen[:max_lookups], max(0, len(chosen) - max_lookups)


def check_found_entry(key: str, found: Any) -> SignedServerRecord | None:
    """The verified record inside one `get` result for a signed key (None if absent); SignedRecordError if the
    entry under the expected subkey is forged or malformed, or if it has expired."""
    value = getattr(found, "value", None)
    if not isinstance(value, Mapping):
        return None
    entry = value.get(key)
    if entry is None:
        return None
    record = verify_signed_entry(key_id_bytes(key), key, getattr(entry, "value", None), entry.expiration_time)
    if record.expiration_time < time.time():
        raise SignedRecordError(f"signed record of {record.peer_id} expired")
    return record


def apply_signed_records(
    infos: list[RemoteModuleInfo],
    records: Mapping[tuple[str, str], SignedServerRecord],
    *,
    active_adapter: str | None = None,
) -> list[RemoteModuleInfo]:
    """For every peer with a verified signed record for a block's prefix: drop the unsigned records about that peer
    and put its signed `ServerInfo` on the blocks of its signed span (and only there). Other peers keep their
    unsigned records (stock Petals servers)."""
    by_prefix: dict[str, dict[str, SignedServerRecord]] = {}
    for (prefix, peer), record in records.items():
        by_prefix.setdefault(prefix, {})[peer] = record
    out = []
    for info in infos:
        try:
            prefix, index = parse_uid(info.uid)
        except ValueError:
            out.append(info)
            continue
        signed = by_prefix.get(prefix, {})
        servers = {peer: server for peer, server in info.servers.items() if peer not in signed}
        for peer, record in signed.items():
            if index in record.span and (not active_adapter or active_adapter in record.server_info.adapters):
                servers[peer] = record.server_info
        out.append(replace(info, servers=servers))
    return out


def vote_model_info(records: Iterable[SignedServerRecord], prefix: str) -> ModelInfo | None:
    """The `ModelInfo` most signed records of `prefix` agree on (ties: fewer blocks), or None if none carries one."""
    votes = Counter(
        (r.model_info.num_blocks, r.model_info.repository)
        for r in records
        if r.prefix == prefix and r.model_info is not None
    )
    if not votes:
        return None
    (num_blocks, repository), _ = min(votes.items(), key=lambda item: (-item[1], item[0][0], str(item[0][1])))
    return ModelInfo(num_blocks=num_blocks, repository=repository)
