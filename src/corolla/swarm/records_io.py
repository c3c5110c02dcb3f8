"""Announcing and reading block records in the DHT with Petals' layout: key `"<prefix>.<i>"`, subkey = peer id
(base58), value = `ServerInfo.to_tuple()`; plus the `_petals.models` index. A corolla server also stores its signed
record (`swarm.signed_records`) in the same batch, and readers let it replace every unsigned record about that peer.
Every call is bounded by `timeout_s`."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Mapping, Sequence
from functools import partial
from typing import Any

import hivemind
from hivemind.p2p import PeerID
from hivemind.utils import get_dht_time
from hivemind.utils.serializer import MSGPackSerializer

from corolla.protocol.records import (
    MAX_EXPIRATION_AHEAD_S,
    MODELS_INDEX_KEY,
    ModelInfo,
    RemoteModuleInfo,
    ServerInfo,
)
from corolla.protocol.uids import make_uid, parse_uid, validate_dht_prefix
from corolla.swarm.dht import DEFAULT_DHT_TIMEOUT_S, call_with_timeout, run_in_dht
from corolla.swarm.identity import get_signer
from corolla.swarm.signed_records import (
    RECENT_SIGNERS,
    SignedRecordError,
    SignedRecords,
    apply_signed_records,
    candidate_pairs,
    check_found_entry,
    sign_server_record,
    signed_record_key,
    vote_model_info,
)
from corolla.utils.logging import get_logger

logger = get_logger(__name__)

# hivemind's DHT intermittently hangs or crashes on values over ~16 KiB (upstream PR 660); ours stay far below
MAX_RECORD_BYTES = 8 * 1024
# signed records looked up per read (one per announced peer): a key flooded with made-up peer ids costs at most this
DEFAULT_MAX_SIGNED_LOOKUPS = 1024
MAX_INDEXED_MODELS = 256  # `_petals.models` prefixes checked against signed records per read


def _check_record_size(what: str, value: Any) -> None:
    size = len(MSGPackSerializer.dumps(value))
    if size > MAX_RECORD_BYTES:
        raise ValueError(f"{what} record is {size} bytes, more than the limit of {MAX_RECORD_BYTES} bytes")


def declare_active_modules(
    dht: hivemind.DHT,
    uids: Sequence[str],
    server_info: ServerInfo,
    expiration_time: float,
    *,
    model_info: ModelInfo | None = None,
    timeout_s: float = DEFAULT_DHT_TIMEOUT_S,
) -> dict[str, bool]:
    """Stores `server_info` under every uid (subkey = this node's peer id); returns per-uid store success. When the
    DHT has a signing identity (`create_dht` gives it one) and `uids` are exactly the span `server_info` names, the
    signed record (`server_info` + `model_info`) goes in the same batch."""
    uids = list(uids)
    prefixes = {parse_uid(uid)[0] for uid in uids}  # ValueError on a malformed uid
    if not uids:
        return {}
    value = server_info.to_tuple()
    _check_record_size("ServerInfo", value)
    signed: tuple[str, str, Any] | None = None
    signer = get_signer(dht)
    span = [parse_uid(uid)[1] for uid in uids]
    if (
        signer is not None
        and len(prefixes) == 1
        and server_info.start_block is not None
        and span == list(range(server_info.start_block, server_info.end_block or 0))
    ):  # only a declaration of the whole span is signed: the signed record speaks for every block of it
        signed = sign_server_record(signer, prefixes.pop(), server_info, model_info, expiration_time)
        _check_record_size("signed ServerInfo", signed[2])
    coro = partial(
        _store_records,
        uids=uids,
        value=value,
        expiration_time=expiration_time,
        signed=signed,
        signer_peer_id=signer.peer_id if signer is not None else None,
    )
    return run_in_dht(dht, coro, timeout_s=timeout_s, what=f"declare_active_modules({uids[0]}.., n={len(uids)})")


async def _store_records(
    dht: hivemind.DHT,
    node: Any,
    *,
    uids: list[str],
    value: Any,
    expiration_time: float,
    signed: tuple[str, str, Any] | None = None,
    signer_peer_id: str | None = None,
) -> dict[str, bool]:
    subkey = node.peer_id.to_base58()
    keys, subkeys, values = list(uids), [subkey] * len(uids), [value] * len(uids)
    if signed is not None and signer_peer_id == subkey:  # sign only as ourselves (a foreign identity would be refused)
        keys.append(signed[0])
        subkeys.append(signed[1])
        values.append(signed[2])
    store_ok = await node.store_many(  # keyed by (key, subkey)
        keys=keys, subkeys=subkeys, values=values, expiration_time=expiration_time,
        num_workers=min(len(keys), dht.num_workers),
    )  # fmt: skip
    if len(keys) > len(uids) and not store_ok.get((keys[-1], subkeys[-1])):
        logger.warning(f"records.signed_store_failed(key={keys[-1][:80]})")
    return {uid: bool(store_ok.get((uid, subkey))) for uid in uids}


def _entries(found: Any) -> Mapping[Any, Any] | None:
    """The `{subkey: ValueWithExpiration}` map of a found key, or None if the key holds a plain value."""
    if found is None:
        return None
    value = getattr(found, "value", found)
    return value if isinstance(value, Mapping) else None


async def _get_records(dht: hivemind.DHT, node: Any, *, keys: list[str], latest: bool) -> dict[str, Any]:
    expiration = math.inf if latest else get_dht_time()  # inf: look for the freshest copy, not the first found
    found = await node.get_many(keys, expiration, num_workers=min(len(keys), dht.num_workers))
    out: dict[str, Any] = {}
    latest_valid = get_dht_time() + MAX_EXPIRATION_AHEAD_S
    for key in keys:
        entries = _entries(found.get(key))
        if entries is None:
            out[key] = None if found.get(key) is None else "not-a-dict"
            continue
        out[key] = {
            subkey: getattr(item, "value", item)
            for subkey, item in entries.items()
            if _expires_by(item, latest_valid, key, subkey)
        }
    return out


def _expires_by(item: Any, latest_valid: float, key: str, subkey: Any) -> bool:
    """Whether a found entry expires no later than `latest_valid` (an entry without an expiration passes)."""
    expiration = getattr(item, "expiration_time", None)
    if isinstance(expiration, (int, float)) and not expiration <= latest_valid:  # (NaN fails too)
        logger.warning(
            f"records.expires_too_late(key={key[:80]}, subkey={str(subkey)[:60]!r}, expiration={expiration!r:.30})"
        )
        return False
    return True


async def _lookup_signed(
    dht: hivemind.DHT, node: Any, *, keys: list[str], raw: dict[str, Any], latest: bool, max_signed_lookups: int
) -> SignedRecords:
    """One batched get of the signed records of every peer announced under `keys`, verified here (cached)."""
    pairs, skipped = candidate_pairs(keys, raw, max_signed_lookups)
    if skipped:
        logger.warning(f"records.signed_lookups_capped(max_signed_lookups={max_signed_lookups}, skipped={skipped})")
    records: SignedRecords = {}
    if not pairs:
        return records
    signed_keys = [signed_record_key(prefix, peer) for prefix, peer in pairs]
    expiration = math.inf if latest else get_dht_time()
    found = await node.get_many(signed_keys, expiration, num_workers=min(len(signed_keys), dht.num_workers))
    for pair, key in zip(pairs, signed_keys, strict=True):
        try:
            record = check_found_entry(key, found.get(key))
        except SignedRecordError as e:
            logger.warning(f"records.signed_refused(peer={pair[1][:60]}): {e}")
            continue
        if record is not None:
            records[pair] = record
    for pair in records:
        RECENT_SIGNERS.put(pair, True)
    return records


async def _get_block_records(
    dht: hivemind.DHT, node: Any, *, keys: list[str], latest: bool, max_signed_lookups: int
) -> tuple[dict[str, Any], SignedRecords]:
    raw = await _get_records(dht, node, keys=keys, latest=latest)
    if max_signed_lookups <= 0:
        return raw, {}
    signed = await _lookup_signed(dht, node, keys=keys, raw=raw, latest=latest, max_signed_lookups=max_signed_lookups)
    return raw, signed


def get_remote_module_infos(
    dht: hivemind.DHT,
    uids: Sequence[str],
    *,
    active_adapter: str | None = None,
    latest: bool = False,
    timeout_s: float = DEFAULT_DHT_TIMEOUT_S,
    max_signed_lookups: int = DEFAULT_MAX_SIGNED_LOOKUPS,
) -> list[RemoteModuleInfo]:
    """Reads who serves each uid (aligned with `uids`). `latest=True` searches for the freshest records instead of
    the first found. Servers lacking `active_adapter` (when given) are left out; malformed records are skipped.
    A peer with a verified signed record is described by that record only (its unsigned ones are ignored); peers
    without one (stock Petals servers) by their unsigned records. `max_signed_lookups=0` reads unsigned only."""
    uids = list(uids)
    if not uids:
        return []
    coro = partial(_get_block_records, keys=uids, latest=latest, max_signed_lookups=max_signed_lookups)
    what = f"get_remote_module_infos({uids[0]}.., n={len(uids)})"
    raw, signed = run_in_dht(dht, coro, timeout_s=timeout_s, what=what)
    infos = []
    for uid in uids:
        info = RemoteModuleInfo(uid=uid, servers={})
        entries = raw.get(uid)
        if entries == "not-a-dict":
            logger.warning(f"records.malformed(uid={uid}): value is not a dictionary of servers, skipped")
        elif entries:
            for subkey, value in entries.items():
                server = _parse_server(uid, subkey, value)
                if server is None:
                    continue
                if active_adapter and active_adapter not in server[1].adapters:
                    continue
                info.servers[server[0]] = server[1]
        infos.append(info)
    return apply_signed_records(infos, signed, active_adapter=active_adapter)


def _parse_server(uid: str, subkey: Any, value: Any) -> tuple[str, ServerInfo] | None:
    try:
        if not isinstance(subkey, str):
            raise ValueError(f"subkey must be a base58 peer id str, got {type(subkey).__name__}")
        peer_id = PeerID.from_base58(subkey).to_base58()
        return peer_id, ServerInfo.from_tuple(value)
    except Exception as e:  # TypeError, ValueError, or PeerID parsing's library-specific errors on garbage
        logger.warning(f"records.malformed(uid={uid}, subkey={str(subkey)[:60]!r}): {e!r:.200}")
        return None


def declare_model_info(
    dht: hivemind.DHT,
    dht_prefix: str,
    model_info: ModelInfo,
    expiration_time: float,
    *,
    timeout_s: float = DEFAULT_DHT_TIMEOUT_S,
) -> bool:
    """Stores the `_petals.models` index entry for `dht_prefix`. Prefixes starting with `_` are private: skipped."""
    validate_dht_prefix(dht_prefix)
    if dht_prefix.startswith("_"):
        return False
    _check_record_size("ModelInfo", model_info.to_dict())
    future = dht.store(
        MODELS_INDEX_KEY, model_info.to_dict(), expiration_time=expiration_time, subkey=dht_prefix, return_future=True
    )
    return bool(call_with_timeout(future, timeout_s, f"declare_model_info({dht_prefix})"))


async def _get_index_and_signed(
    dht: hivemind.DHT, node: Any, *, max_signed_lookups: int
) -> tuple[dict[str, Any], SignedRecords]:
    """The raw `_petals.models` entries and the signed records of the servers of each indexed model's first block
    (and last block, if the entry names a plausible size)."""
    index = (await _get_records(dht, node, keys=[MODELS_INDEX_KEY], latest=True)).get(MODELS_INDEX_KEY)
    if not isinstance(index, dict):
        return {}, {}
    entries: dict[str, Any] = {}
    probe: list[str] = []
    for prefix, value in index.items():
        try:
            probe.append(make_uid(prefix, 0))  # ValueError on a malformed prefix
        except ValueError:
            continue
        entries[prefix] = value
        with contextlib.suppress(TypeError, ValueError):
            probe.append(make_uid(prefix, ModelInfo.from_dict(value).num_blocks - 1))
        if len(entries) >= MAX_INDEXED_MODELS:
            logger.warning(f"records.index_capped(max_models={MAX_INDEXED_MODELS})")
            break
    if not probe:
        return entries, {}
    keys = list(dict.fromkeys(probe))
    _, signed = await _get_block_records(dht, node, keys=keys, latest=True, max_signed_lookups=max_signed_lookups)
    return entries, signed


def get_verified_model_infos(
    dht: hivemind.DHT,
    *,
    timeout_s: float = DEFAULT_DHT_TIMEOUT_S,
    max_signed_lookups: int = DEFAULT_MAX_SIGNED_LOOKUPS,
) -> dict[str, ModelInfo]:
    """The `_petals.models` index as a corolla reader should believe it: every prefix named there, even one whose
    entry was overwritten with garbage, described by the `ModelInfo` its servers' signed records agree on; the
    unsigned entry is used only for models no signed record speaks for (stock Petals servers: forgeable)."""
    coro = partial(_get_index_and_signed, max_signed_lookups=max_signed_lookups)
    entries, signed_records = run_in_dht(dht, coro, timeout_s=timeout_s, what="get_verified_model_infos")
    models = {}
    for prefix, value in entries.items():
        signed = vote_model_info(signed_records.values(), prefix)
        if signed is not None:
            models[prefix] = signed
            continue
        try:
            models[prefix] = ModelInfo.from_dict(value)
        except (TypeError, ValueError) as e:
            logger.warning(f"records.malformed(key={MODELS_INDEX_KEY}, subkey={prefix[:60]!r}): {e}")
    return models
