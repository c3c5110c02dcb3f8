"""A simulated server's prefix cache (issue 34): what its pool keeps of conversations whose session closed, in
tokens per (conversation, layer span), least recently used forgotten first once `capacity_tokens` is exceeded. A
cached entry serves only the same span (the real pool keys pages by the session's layers) and whole 16-token
blocks (the client's keys)."""

from __future__ import annotations

from collections import OrderedDict

from corolla.protocol.prefix import PREFIX_BLOCK_TOKENS


class ServerPrefixCache:
    """Conversation id and span -> positions cached (whole blocks), LRU-bounded in tokens."""

    def __init__(self, capacity_tokens: int):
        if capacity_tokens < 0:
            raise ValueError(f"capacity_tokens must be >= 0, got {capacity_tokens}")
        self.capacity_tokens = capacity_tokens
        self._entries: OrderedDict[tuple[int, int, int], int] = OrderedDict()
        self.cached_tokens = 0
        self.evictions = 0

    def hit(self, conversation: int, start: int, end: int) -> int:
        """Positions of `conversation` cached for blocks [start, end) (0 if none); a hit is a use (LRU)."""
        key = (conversation, start, end)
        tokens = self._entries.get(key, 0)
        if tokens:
            self._entries.move_to_end(key)
        return tokens

    def store(self, conversation: int, start: int, end: int, positions: int) -> None:
        """The session of `conversation` over [start, end) closed with `positions` computed: its whole blocks stay
        cached (replacing an older entry of the same conversation and span), evicting the least recently used."""
        key = (conversation, start, end)
        self.cached_tokens -= self._entries.pop(key, 0)
        tokens = positions // PREFIX_BLOCK_TOKENS * PREFIX_BLOCK_TOKENS
        if tokens == 0 or tokens > self.capacity_tokens:
            return
        self._entries[key] = tokens
        self.cached_tokens += tokens
        while self.cached_tokens > self.capacity_tokens:
            _, dropped = self._entries.popitem(last=False)
            self.cached_tokens -= dropped
            self.evictions += 1
