"""The block uid grammar shared with Petals: `"<prefix>.<index>"` per block, chains of uids joined by one space."""

from __future__ import annotations

UID_DELIMITER = "."
CHAIN_DELIMITER = " "


def validate_dht_prefix(prefix: str) -> str:
    """Returns `prefix` if it can name blocks: a non-empty str without `.` or space, else ValueError."""
    if not isinstance(prefix, str) or not prefix:
        raise ValueError(f"dht_prefix must be a non-empty str, got {prefix!r}")
    if UID_DELIMITER in prefix or CHAIN_DELIMITER in prefix:
        raise ValueError(f"dht_prefix must not contain {UID_DELIMITER!r} or a space, got {prefix!r}")
    return prefix


def make_uid(prefix: str, index: int) -> str:
    validate_dht_prefix(prefix)
    if isinstance(index, bool) or not isinstance(index, int) or index < 0:
        raise ValueError(f"block index must be an int >= 0, got {index!r}")
    return f"{prefix}{UID_DELIMITER}{index}"


def parse_uid(uid: str) -> tuple[str, int]:
    """`"p.7" -> ("p", 7)`; exactly one dot, a valid prefix and a decimal index >= 0, else ValueError."""
    if not isinstance(uid, str):
        raise ValueError(f"uid must be a str, got {type(uid).__name__}")
    if CHAIN_DELIMITER in uid:
        raise ValueError(f"parse_uid takes one uid, not a chain: {uid!r:.200}")
    parts = uid.split(UID_DELIMITER)
    if len(parts) != 2:
        raise ValueError(f"uid must look like '<prefix>.<index>', got {uid!r:.200}")
    prefix, index = parts
    validate_dht_prefix(prefix)
    if not index.isascii() or not index.isdigit():
        raise ValueError(f"uid index must be a decimal int >= 0, got {uid!r:.200}")
    return prefix, int(index)


def make_chain(prefix: str, start: int, end: int) -> str:
    """The chain of blocks `[start, end)` as sent in `ExpertRequest.uid`: `"p.3 p.4 p.5"`."""
    if not 0 <= start < end:
        raise ValueError(f"chain must be a non-empty range 0 <= start < end, got [{start}, {end})")
    return CHAIN_DELIMITER.join(make_uid(prefix, i) for i in range(start, end))


def parse_chain(chain: str) -> list[str]:
    """Splits a chain into its uids, validating each one (no empty items, no double spaces)."""
    if not isinstance(chain, str) or not chain:
        raise ValueError(f"uid chain must be a non-empty str, got {chain!r:.200}")
    uids = chain.split(CHAIN_DELIMITER)
    for uid in uids:
        parse_uid(uid)
    return uids
