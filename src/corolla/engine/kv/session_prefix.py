"""One session's prefix chain on the engine: the chain hashes its client named for its token blocks
(`protocol.prefix.PrefixKeys`, blocks of `PREFIX_BLOCK_TOKENS`) turned into the keys of the pool's whole pages, and
how far its pages are published. A page is named by the hash of the block that ends at its last position."""

from __future__ import annotations

from dataclasses import dataclass, field

from corolla.engine.kv.prefix_index import PrefixKey
from corolla.protocol.prefix import PREFIX_BLOCK_TOKENS, PrefixKeys


@dataclass
class SessionPrefix:
    """The keys of one single-sequence session over `layers`, reusable by sessions of `namespace`. `hashes` holds at
    most `max_blocks` entries (the session's maximum length in blocks): a client can't grow it past its cache."""

    namespace: str
    layers: tuple[int, int]
    page_tokens: int
    max_blocks: int
    hashes: dict[int, bytes] = field(default_factory=dict)  # block index -> chain hash ending that block
    next_page: int = 0  # pages before it are published, attached or were refused by the index

    def __post_init__(self) -> None:
        if self.page_tokens % PREFIX_BLOCK_TOKENS:
            raise ValueError(
                f"pages of {self.page_tokens} tokens are no whole number of {PREFIX_BLOCK_TOKENS}-token blocks"
            )

    def add(self, keys: PrefixKeys) -> None:
        """Records the client's hashes of blocks `keys.first_block` on (replacing earlier ones: a client that rewrote
        tokens names them anew); blocks past the session's maximum length are ignored."""
        for offset, chain_hash in enumerate(keys.hashes[: max(0, self.max_blocks - keys.first_block)]):
            self.hashes[keys.first_block + offset] = chain_hash

    def page_key(self, page: int) -> PrefixKey | None:
        """The key of page `page` (positions [page * page_tokens, (page + 1) * page_tokens)), None while the hash of
        its last block is unknown."""
        chain_hash = self.hashes.get((page + 1) * (self.page_tokens // PREFIX_BLOCK_TOKENS) - 1)
        return None if chain_hash is None else PrefixKey(self.namespace, self.layers, chain_hash)

    def keys_from(self, page: int) -> list[PrefixKey]:
        """The keys of pages `page`, `page + 1`, ... up to the first page without one."""
        keys: list[PrefixKey] = []
        while (key := self.page_key(page + len(keys))) is not None:
            keys.append(key)
        return keys

    def rewind(self, position: int) -> None:
        """A step writes from `position` on: pages from the one holding it are published again once refilled."""
        self.next_page = min(self.next_page, position // self.page_tokens)
