"""The prefix index of a `KVPool`: which page holds the keys/values of a named prefix (the client's chain hash ending at
the page's last position, within one identity namespace and layer span), and the least-recently-used order of the
cached pages that no session holds (the only pages an allocation may evict)."""

from __future__ import annotations

from collections import Counter, OrderedDict
from dataclasses import dataclass

# one page held over a session's layers: ((first, end), page id); sessions over overlapping layers never hold the
# same page id, so this names one unit of the pool
PageBlock = tuple[tuple[int, int], int]


@dataclass(frozen=True)
class PrefixKey:
    """What a cached page is found by: positions up to the page's end, as named by a client's hash chain
    (`protocol.prefix.chain_hashes`), computed over `layers` by sessions of `namespace` (the identity allowed to
    reuse it: a client and its adapter, or one shared namespace where the operator opted in)."""

    namespace: str
    layers: tuple[int, int]
    chain_hash: bytes


class PrefixIndex:
    """PrefixKey -> page, the page -> key map back, and the idle (cached, unreferenced) pages in least-recently-used
    order. Not thread-safe: the pool calls it under its lock."""

    def __init__(self) -> None:
        self._pages: dict[PrefixKey, int] = {}
        self._keys: dict[PageBlock, PrefixKey] = {}
        self._idle: OrderedDict[PageBlock, None] = OrderedDict()  # oldest first
        self.idle_layer_pages = 0  # idle pages summed over their layers
        self.idle_by_layers: Counter[tuple[int, int]] = Counter()  # idle pages per layer range
        self.layer_pages = 0  # indexed pages (held or idle) summed over their layers

    def __len__(self) -> int:
        return len(self._pages)

    def get(self, key: PrefixKey) -> int | None:
        return self._pages.get(key)

    def key_of(self, block: PageBlock) -> PrefixKey | None:
        return self._keys.get(block)

    def insert(self, key: PrefixKey, page: int) -> bool:
        """Indexes a held page under `key`; False (nothing changes) if the key or the page is indexed already: the
        first page computed under a key stays its page."""
        block = (key.layers, page)
        if key in self._pages or block in self._keys:
            return False
        self._pages[key] = page
        self._keys[block] = key
        self.layer_pages += key.layers[1] - key.layers[0]
        return True

    def remove(self, block: PageBlock) -> None:
        """Drops a held page's entry (its positions are about to change)."""
        key = self._keys.pop(block)
        del self._pages[key]
        self.layer_pages -= key.layers[1] - key.layers[0]
        assert block not in self._idle, "an idle page is removed only by eviction"

    def set_idle(self, block: PageBlock) -> None:
        """The last session holding an indexed page let it go: it becomes the most recently used idle page."""
        self._idle[block] = None
        self.idle_layer_pages += block[0][1] - block[0][0]
        self.idle_by_layers[block[0]] += 1

    def set_held(self, block: PageBlock) -> None:
        """A session took an idle page back."""
        del self._idle[block]
        self.idle_layer_pages -= block[0][1] - block[0][0]
        self.idle_by_layers[block[0]] -= 1
        if not self.idle_by_layers[block[0]]:
            del self.idle_by_layers[block[0]]

    def is_idle(self, block: PageBlock) -> bool:
        return block in self._idle

    def idle_blocks(self) -> list[PageBlock]:
        """The idle pages, least recently used first."""
        return list(self._idle)

    def evict(self, layers: tuple[int, int]) -> PageBlock | None:
        """Removes the least recently used idle page held in layers overlapping [first, end) and returns it (the
        pool frees it), or None if there is none."""
        first, end = layers
        for block in self._idle:
            (b_first, b_end), _ = block
            if b_first < end and first < b_end:
                self.set_held(block)
                self.remove(block)
                return block
        return None
