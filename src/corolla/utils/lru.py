"""`Lru`: a map bounded to its `max_entries` most recently stored entries (and, unless told otherwise, read ones),
behind one lock: for caches and logs whose keys arrive from the network or from requests, which must not grow with
them."""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Generic, TypeVar

K = TypeVar("K")
V = TypeVar("V")


class Lru(Generic[K, V]):
    """Thread-safe; `get` counts `hits` and `misses`. `reads_refresh=False`: a read leaves an entry's age alone (a
    log, whose order is the order of storing)."""

    def __init__(self, max_entries: int, *, reads_refresh: bool = True):
        self.max_entries = max_entries
        self.reads_refresh = reads_refresh
        self._entries: OrderedDict[K, V] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    def get(self, key: K) -> V | None:
        with self._lock:
            value = self._entries.get(key)
            if value is None:
                self.misses += 1
            else:
                self.hits += 1
                if self.reads_refresh:
                    self._entries.move_to_end(key)
            return value

    def put(self, key: K, value: V) -> None:
        with self._lock:
            self._entries[key] = value
            self._entries.move_to_end(key)
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)

    def __contains__(self, key: object) -> bool:
        with self._lock:
            return key in self._entries

    def values(self) -> list[V]:
        """The values, the oldest first."""
        with self._lock:
            return list(self._entries.values())

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self.hits = self.misses = 0
