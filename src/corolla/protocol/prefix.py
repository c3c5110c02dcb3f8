"""corolla-only metadata for prefix caching. Servers see hidden states, not tokens, so the client names a session's
prefix: a hash chain over blocks of `PREFIX_BLOCK_TOKENS` tokens, rooted in everything that changes the states (model,
adapter, position offset, prompts). The server answers how many leading positions it already holds. Stock Petals
peers ignore both keys, so this is a wire-compatible extension."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

PREFIX_BLOCK_TOKENS = 16  # tokens per hashed block; a server reuses whole pages, a multiple of this
PREFIX_DIGEST_BYTES = 16
MAX_PREFIX_BLOCKS = 8192  # 131,072 tokens: more than any served model's positions
PREFIX_KEY = "corolla.prefix"  # request metadata of an inference step: PrefixKeys.to_wire()
PREFIX_HIT_KEY = "corolla.prefix_hit"  # response metadata of a session's first step: positions the server reused


@dataclass(frozen=True)
class PrefixKeys:
    """Chain hashes of consecutive token blocks of one session: `hashes[i]` ends block `first_block + i`, which covers
    positions [PREFIX_BLOCK_TOKENS * b, PREFIX_BLOCK_TOKENS * (b + 1)) of the session."""

    first_block: int
    hashes: tuple[bytes, ...]

    def __post_init__(self) -> None:
        if not 0 <= self.first_block < MAX_PREFIX_BLOCKS:
            raise ValueError(f"{PREFIX_KEY}: first block must be in [0, {MAX_PREFIX_BLOCKS}), got {self.first_block}")
        if self.first_block + len(self.hashes) > MAX_PREFIX_BLOCKS:
            raise ValueError(
                f"{PREFIX_KEY}: at most {MAX_PREFIX_BLOCKS} blocks, got {self.first_block}+{len(self.hashes)}"
            )
        if any(not isinstance(h, bytes) or len(h) != PREFIX_DIGEST_BYTES for h in self.hashes):
            raise ValueError(f"{PREFIX_KEY}: every hash must be {PREFIX_DIGEST_BYTES} bytes")

    @property
    def end_block(self) -> int:
        return self.first_block + len(self.hashes)

    @property
    def end_position(self) -> int:
        """The position after the last keyed block."""
        return self.end_block * PREFIX_BLOCK_TOKENS

    def to_wire(self) -> dict[str, Any]:
        return {"first": self.first_block, "hashes": list(self.hashes)}

    @classmethod
    def from_wire(cls, value: Any) -> PrefixKeys:
        """ValueError unless `value` is `{"first": int, "hashes": [bytes, ...]}` within the limits (checked before
        anything is built from it)."""
        if not isinstance(value, Mapping) or set(value) != {"first", "hashes"}:
            raise ValueError(f"{PREFIX_KEY} must be a dict with keys 'first' and 'hashes'")
        first, hashes = value["first"], value["hashes"]
        if not isinstance(first, int) or isinstance(first, bool):
            raise ValueError(f"{PREFIX_KEY}['first'] must be an int, got {type(first).__name__}")
        if not isinstance(hashes, (list, tuple)) or len(hashes) > MAX_PREFIX_BLOCKS:
            raise ValueError(f"{PREFIX_KEY}['hashes'] must be a list of at most {MAX_PREFIX_BLOCKS} hashes")
        return cls(first_block=first, hashes=tuple(hashes))


def parse_prefix_keys(metadata_extra: Mapping[str, Any]) -> PrefixKeys | None:
    """The prefix keys of a request's extra metadata (None when absent); ValueError when malformed."""
    value = metadata_extra.get(PREFIX_KEY)
    return None if value is None else PrefixKeys.from_wire(value)


def parse_prefix_hit(response_metadata: Mapping[str, Any], *, max_positions: int) -> int:
    """Positions a server says it reused (0 when absent: a stock Petals server); ValueError when it is not an int in
    [0, max_positions] or not a whole number of blocks."""
    value = response_metadata.get(PREFIX_HIT_KEY, 0)
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= max_positions:
        raise ValueError(f"{PREFIX_HIT_KEY} must be an int in [0, {max_positions}], got {value!r:.40}")
    if value % PREFIX_BLOCK_TOKENS:
        raise ValueError(f"{PREFIX_HIT_KEY}={value} is not a multiple of {PREFIX_BLOCK_TOKENS}")
    return value


def prefix_root(*, model: str, adapter: str = "", position_offset: int = 0, prompts_digest: bytes = b"") -> bytes:
    """The chain's root: everything besides the tokens that changes the hidden states a span computes."""
    h = hashlib.blake2b(digest_size=PREFIX_DIGEST_BYTES, person=b"corolla.prefix")
    for part in (model.encode(), adapter.encode(), str(int(position_offset)).encode(), prompts_digest):
        h.update(len(part).to_bytes(4, "little"))
        h.update(part)
    return h.digest()


def chain_hashes(parent: bytes, token_ids: Sequence[int]) -> list[bytes]:
    """Chain hashes of the whole blocks of `token_ids` (a trailing partial block is not keyed), each over its parent's
    hash and its tokens; `parent` is the root for block 0, else the hash ending the block before `token_ids`."""
    out = []
    for start in range(0, len(token_ids) - PREFIX_BLOCK_TOKENS + 1, PREFIX_BLOCK_TOKENS):
        block = token_ids[start : start + PREFIX_BLOCK_TOKENS]
        h = hashlib.blake2b(parent, digest_size=PREFIX_DIGEST_BYTES)
        h.update(b"".join(int(t).to_bytes(4, "little", signed=True) for t in block))
        parent = h.digest()
        out.append(parent)
    return out
