"""`swarm.bounded_storage` on hivemind's `DHTLocalStorage`: past `MAX_SUBKEYS_PER_KEY` subkeys or
`MAX_DICTIONARY_BYTES` under a key a new subkey is refused while the ones there still refresh; an entry over
`MAX_ENTRY_BYTES` or valid more than a day ahead is refused; other keys are not affected."""

from __future__ import annotations

import pytest
from hivemind.dht.routing import DHTID
from hivemind.dht.storage import DHTLocalStorage, DictionaryDHTValue
from hivemind.utils import get_dht_time

from corolla.swarm import bounded_storage as bs

KEY, OTHER = DHTID.generate(source="m.0"), DHTID.generate(source="m.1")


@pytest.fixture()
def storage():
    with pytest.MonkeyPatch.context() as patch:  # hivemind's own method is back on exit
        patch.setattr(DHTLocalStorage, "store_subkey", DHTLocalStorage.__dict__["store_subkey"])
        bs.install_bounded_storage()
        assert bs.bounded_storage_installed()
        yield DHTLocalStorage()


def _subkeys(storage: DHTLocalStorage, key: DHTID) -> set:
    return {subkey for subkey, _ in storage.get(key).value.items()}


def test_a_full_key_refuses_new_subkeys_and_refreshes_old_ones(storage):
    later = get_dht_time() + 60
    assert storage.store(KEY, b"honest", later, subkey="QmHonest")
    for i in range(bs.MAX_SUBKEYS_PER_KEY - 1):
        assert storage.store(KEY, b"", later, subkey=f"j{i}")
    assert not storage.store(KEY, b"", later, subkey="one-more")
    assert storage.store(KEY, b"honest, refreshed", later + 60, subkey="QmHonest")
    assert storage.get(KEY).value.get("QmHonest").value == b"honest, refreshed"
    assert len(_subkeys(storage, KEY)) == bs.MAX_SUBKEYS_PER_KEY
    assert storage.store(OTHER, b"", later, subkey="one-more")  # per key


def test_a_key_holds_at_most_its_bytes(storage):
    later = get_dht_time() + 60
    value = bytes(10_000)
    stored = [i for i in range(64) if storage.store(KEY, value, later, subkey=f"Qm{i}")]
    assert 0 < len(stored) <= bs.MAX_DICTIONARY_BYTES // len(value) < 64
    assert not storage.store(
        KEY, value + bytes(2_000), later + 1, subkey=f"Qm{stored[0]}"
    )  # a refresh may not grow past it
    assert storage.store(KEY, b"small", later + 1, subkey=f"Qm{stored[0]}")


def test_an_oversized_or_far_future_entry_is_refused(storage):
    now = get_dht_time()
    assert not storage.store(KEY, bytes(bs.MAX_ENTRY_BYTES + 1), now + 60, subkey="QmBig")
    assert not storage.store(KEY, b"ghost", now + 10 * 365 * 86400, subkey="QmGhost")
    assert not storage.store(KEY, b"nan", float("nan"), subkey="QmNan")
    assert storage.store(KEY, b"fine", now + 60, subkey="QmFine")
    assert _subkeys(storage, KEY) == {"QmFine"}


def test_a_full_key_does_not_recount_its_entries_on_every_store(storage, monkeypatch):
    """The bound's cost: summing a full key's 1024 entries on every store took ~140 us (dev VM), so one 4 MiB store
    request of ~90,000 subkeys under it held the DHT process's loop ~14 s. The entries' bytes are counted again only
    where some expired; refused new subkeys and refreshes do not walk them."""
    later = get_dht_time() + 60
    for i in range(bs.MAX_SUBKEYS_PER_KEY):
        assert storage.store(KEY, b"x" * 8, later, subkey=f"s{i}")
    walks = []
    items = DictionaryDHTValue.items
    monkeypatch.setattr(DictionaryDHTValue, "items", lambda self: walks.append(1) or items(self))
    for i in range(200):
        assert not storage.store(KEY, b"", later, subkey=f"new{i}")  # past the subkeys
        assert storage.store(KEY, b"y" * 8, later + 1 + i, subkey=f"s{i}")  # a refresh of one held
    assert len(walks) <= 1
    # the bytes bound still holds where refreshes grow the entries (counted as they are stored, not summed again)
    big = b"z" * (bs.MAX_ENTRY_BYTES - 64)
    grown = sum(storage.store(KEY, big, later + 300, subkey=f"s{i}") for i in range(bs.MAX_SUBKEYS_PER_KEY))
    assert 0 < grown < bs.MAX_SUBKEYS_PER_KEY
    held = sum(len(str(k)) + len(item.value) for k, item in items(storage.get(KEY).value))
    assert bs.MAX_DICTIONARY_BYTES - len(big) < held <= bs.MAX_DICTIONARY_BYTES
