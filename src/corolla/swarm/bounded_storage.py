"""Bounds on what a corolla DHT node stores under one key: hivemind's `DHTLocalStorage.store_subkey` (every subkey a
peer stores, a lookup caches, or a joining node is handed) refuses a new subkey once the key's dictionary holds
`MAX_SUBKEYS_PER_KEY` entries or `MAX_DICTIONARY_BYTES`, an entry over `MAX_ENTRY_BYTES`, and one valid further
ahead than `MAX_EXPIRATION_AHEAD_S`. Subkeys already there are refreshed as before (within the bytes), so servers
that announce before a flood keep their place; the bounds hold with no identity to check (made-up peer ids are free).

Why: hivemind keeps every subkey anyone stores under a block key, and answers a lookup with the whole dictionary in
one p2p message of at most 4 MiB, a lookup carrying up to sqrt(keys asked) keys. One peer storing made-up subkeys
past that made the node unable to answer any lookup holding that key, for every reader (the p2p layer refuses the
answer, hivemind drops the node from the reader's routing table): no server of the block from that node. At 128 KiB
a key, 20 flooded keys in one answer still fit; honest records are 0.3-1 KiB (a few hundred servers a block)."""

from __future__ import annotations

import threading
from typing import Any

from hivemind.dht.storage import DHTLocalStorage, DictionaryDHTValue
from hivemind.utils import get_dht_time

from corolla.protocol.records import MAX_EXPIRATION_AHEAD_S
from corolla.utils.logging import get_logger

logger = get_logger(__name__)

MAX_SUBKEYS_PER_KEY = 1024
MAX_DICTIONARY_BYTES = 128 * 1024  # subkeys' and values' bytes under one key
MAX_ENTRY_BYTES = 16 * 1024  # one value (corolla's records are at most 8 KiB; hivemind misbehaves past ~16 KiB)

_install_lock = threading.Lock()
_hivemind_store_subkey = DHTLocalStorage.store_subkey


def _entry_bytes(subkey: Any, value: Any) -> int:
    return len(str(subkey)) + (len(value) if isinstance(value, (bytes, bytearray)) else MAX_ENTRY_BYTES)


def _bounded_store_subkey(self: DHTLocalStorage, key: Any, subkey: Any, value: Any, expiration_time: float) -> bool:
    size = _entry_bytes(subkey, value)
    if size > MAX_ENTRY_BYTES or not expiration_time <= get_dht_time() + MAX_EXPIRATION_AHEAD_S:
        logger.debug(
            f"dht_storage.refused(subkey={str(subkey)[:60]!r}, bytes={size}, expiration={expiration_time!r:.30})"
        )
        return False
    current = self.get(key)
    dictionary = current.value if current is not None else None
    if isinstance(dictionary, DictionaryDHTValue):
        entries = list(dictionary.items())  # (the expired ones dropped first)
        old = dictionary.get(subkey)
        held = sum(_entry_bytes(k, item.value) for k, item in entries)
        held -= _entry_bytes(subkey, old.value) if old is not None else 0
        if (old is None and len(entries) >= MAX_SUBKEYS_PER_KEY) or held + size > MAX_DICTIONARY_BYTES:
            logger.debug(f"dht_storage.key_full(subkeys={len(entries)}, bytes={held}, new={old is None})")
            return False
    return _hivemind_store_subkey(self, key, subkey, value, expiration_time)


_bounded_store_subkey.__wrapped__ = _hivemind_store_subkey  # type: ignore[attr-defined]  # hivemind's own


def install_bounded_storage() -> None:
    """Makes hivemind's `DHTLocalStorage.store_subkey` apply the bounds above. Idempotent; call before the DHT
    process forks so the child inherits it."""
    with _install_lock:
        if not bounded_storage_installed():
            DHTLocalStorage.store_subkey = _bounded_store_subkey
            logger.debug("dht_storage.bounds_installed()")


def bounded_storage_installed() -> bool:
    return DHTLocalStorage.__dict__["store_subkey"] is _bounded_store_subkey
