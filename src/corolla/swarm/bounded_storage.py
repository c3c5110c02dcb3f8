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
import weakref
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


# a stored dictionary -> (its entries, their bytes) when last counted: exact while the number of entries is the same
# (entries enter through `_bounded_store_subkey`, which updates it, and leave by expiring, which lowers the number).
# Summing the entries on every store cost ~140 us at 1024 of them (dev VM): one 4 MiB store request of ~90,000
# subkeys under a full key held the DHT process's loop ~14 s.
_held: weakref.WeakKeyDictionary[DictionaryDHTValue, tuple[int, int]] = weakref.WeakKeyDictionary()


def _held_bytes(dictionary: DictionaryDHTValue, entries: int) -> int:
    """The bytes of the `entries` unexpired entries of `dictionary` (summed only where they changed otherwise)."""
    counted = _held.get(dictionary)
    if counted is None or counted[0] != entries:
        counted = _held[dictionary] = (entries, sum(_entry_bytes(k, item.value) for k, item in dictionary.items()))
    return counted[1]


def _bounded_store_subkey(self: DHTLocalStorage, key: Any, subkey: Any, value: Any, expiration_time: float) -> bool:
    size = _entry_bytes(subkey, value)
    if size > MAX_ENTRY_BYTES or not expiration_time <= get_dht_time() + MAX_EXPIRATION_AHEAD_S:
        logger.debug(
            f"dht_storage.refused(subkey={str(subkey)[:60]!r}, bytes={size}, expiration={expiration_time!r:.30})"
        )
        return False
    current = self.get(key)
    dictionary = current.value if current is not None else None
    if not isinstance(dictionary, DictionaryDHTValue):
        return _hivemind_store_subkey(self, key, subkey, value, expiration_time)
    entries = len(dictionary)  # (the expired ones dropped first)
    old = dictionary.get(subkey)
    if old is None and entries >= MAX_SUBKEYS_PER_KEY:
        logger.debug(f"dht_storage.key_full(subkeys={entries}, new=True)")
        return False
    held = _held_bytes(dictionary, entries) - (_entry_bytes(subkey, old.value) if old is not None else 0)
    if held + size > MAX_DICTIONARY_BYTES:
        logger.debug(f"dht_storage.key_full(subkeys={entries}, bytes={held}, new={old is None})")
        return False
    stored = _hivemind_store_subkey(self, key, subkey, value, expiration_time)
    if stored:  # (into `dictionary`: hivemind replaces only a plain value)
        _held[dictionary] = (entries + (old is None), held + size)
    return stored


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
