"""Announcing and reading block records in the DHT with Petals' layout: key `"<prefix>.<i>"`, subkey = peer id
(base58), value = `ServerInfo.to_tuple()`; plus the `_petals.models` index. Every call is bounded by `timeout_s`."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from functools import partial
from typing import Any

import hivemind
from hivemind.p2p import PeerID
from hivemind.utils import get_dht_time
from hivemind.utils.serializer import MSGPackSerializer

from corolla.protocol.records import MODELS_INDEX_KEY, ModelInfo, RemoteModuleInfo, ServerInfo
from corolla.protocol.uids import parse_uid, validate_dht_prefix
from corolla.swarm.dht import DEFAULT_DHT_TIMEOUT_S, call_with_timeout, run_in_dht
from corolla.utils.logging import get_logger

logger = get_logger(__name__)

# hivemind's DHT intermittently hangs or crashes on values over ~16 KiB (upstream PR 660); ours stay far below
MAX_RECORD_BYTES = 8 * 1024


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
    timeout_s: float = DEFAULT_DHT_TIMEOUT_S,
) -> dict[str, bool]:
    """Stores `server_info` under every uid (subkey = this node's peer id); returns per-uid store success."""
    uids = list(uids)
    for uid in uids:
        parse_uid(uid)  # ValueError on a malformed uid
    if not uids:
        return {}
    value = server_info.to_tuple()
    _check_record_size("ServerInfo", value)
    coro = partial(_store_records, uids=uids, value=value, expiration_time=expiration_time)
    return run_in_dht(dht, coro, timeout_s=timeout_s, what=f"declare_active_modules({uids[0]}.., n={len(uids)})")


async def _store_records(
    dht: hivemind.DHT, node: Any, *, uids: list[str], value: Any, expiration_time: float
) -> dict[str, bool]:
    subkey = node.peer_id.to_base58()
    store_ok = await node.store_many(
        keys=uids,
        subkeys=[subkey] * len(uids),
        values=[value] * len(uids),
        expiration_time=expiration_time,
        num_workers=min(len(uids), dht.num_workers),
    )  # keyed by (key, subkey)
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
    for key in keys:
        entries = _entries(found.get(key))
        if entries is None:
            out[key] = None if found.get(key) is None else "not-a-dict"
            continue
        out[key] = {subkey: getattr(item, "value", item) for subkey, item in entries.items()}
    return out


def get_remote_module_infos(
    dht: hivemind.DHT,
    uids: Sequence[str],
    *,
    active_adapter: str | None = None,
    latest: bool = False,
    timeout_s: float = DEFAULT_DHT_TIMEOUT_S,
) -> list[RemoteModuleInfo]:
    """Reads who serves each uid (aligned with `uids`). `latest=True` searches for the freshest records instead of
    the first found. Servers lacking `active_adapter` (when given) are left out; malformed records are skipped."""
    uids = list(uids)
    if not uids:
        return []
    coro = partial(_get_records, keys=uids, latest=latest)
    raw = run_in_dht(dht, coro, timeout_s=timeout_s, what=f"get_remote_module_infos({uids[0]}.., n={len(uids)})")
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
    return infos


def _parse_server(uid: str, subkey: Any, value: Any) -> tuple[str, ServerInfo] | None:
    try:
        if not isinstance(subkey, str):
            raise ValueError(f"subkey must be a base58 peer id str, got {type(subkey).__name__}")
        peer_id = PeerID.from_base58(subkey).to_base58()
        return peer_id, ServerInfo.from_tuple(value)
    except (TypeError, ValueError) as e:
        logger.warning(f"records.malformed(uid={uid}, subkey={str(subkey)[:60]!r}): {e}")
        return None
    except Exception as e:  # PeerID parsing raises library-specific errors on garbage
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
        MODELS_INDEX_KEY,
        model_info.to_dict(),
        expiration_time=expiration_time,
        subkey=dht_prefix,
        return_future=True,
    )
    return bool(call_with_timeout(future, timeout_s, f"declare_model_info({dht_prefix})"))


def get_model_infos(
    dht: hivemind.DHT, *, latest: bool = True, timeout_s: float = DEFAULT_DHT_TIMEOUT_S
) -> dict[str, ModelInfo]:
    """Reads the `_petals.models` index: `{dht_prefix: ModelInfo}`; malformed entries are skipped with a log line."""
    coro = partial(_get_records, keys=[MODELS_INDEX_KEY], latest=latest)
    raw = run_in_dht(dht, coro, timeout_s=timeout_s, what="get_model_infos").get(MODELS_INDEX_KEY)
    if not isinstance(raw, dict):
        return {}
    models = {}
    for prefix, value in raw.items():
        try:
            if not isinstance(prefix, str):
                raise ValueError("prefix must be a str")
            validate_dht_prefix(prefix)
            models[prefix] = ModelInfo.from_dict(value)
        except (TypeError, ValueError) as e:
            logger.warning(f"records.malformed(key={MODELS_INDEX_KEY}, subkey={str(prefix)[:60]!r}): {e}")
    return models
