"""The prefix-cache wire keys: bounded parsing of what a peer sends, and a chain that names tokens and their history."""

import pytest

from corolla.protocol.prefix import (
    MAX_PREFIX_BLOCKS,
    PREFIX_BLOCK_TOKENS,
    PREFIX_HIT_KEY,
    PREFIX_KEY,
    PrefixKeys,
    chain_hashes,
    parse_prefix_hit,
    parse_prefix_keys,
    prefix_root,
)


def test_chain_names_the_whole_history_not_only_the_block():
    root = prefix_root(model="m", adapter="")
    a = chain_hashes(root, list(range(48)))
    assert len(a) == 3  # whole blocks only
    b = chain_hashes(root, [99] + list(range(1, 48)))
    assert all(x != y for x, y in zip(a, b, strict=True))  # a change in block 0 changes every later hash
    assert chain_hashes(a[0], list(range(16, 48))) == a[1:]  # a chain continues from its last hash
    assert chain_hashes(prefix_root(model="m", adapter="lora"), list(range(48)))[0] != a[0]
    assert chain_hashes(prefix_root(model="m", position_offset=1), list(range(48)))[0] != a[0]


def test_keys_round_trip_and_refuse_malformed_input():
    keys = PrefixKeys(first_block=2, hashes=tuple(chain_hashes(prefix_root(model="m"), list(range(32)))))
    assert parse_prefix_keys({PREFIX_KEY: keys.to_wire()}) == keys
    assert keys.end_position == 4 * PREFIX_BLOCK_TOKENS
    assert parse_prefix_keys({}) is None
    for bad in (
        [1, 2],
        {"first": 0},
        {"first": "0", "hashes": []},
        {"first": True, "hashes": []},
        {"first": -1, "hashes": []},
        {"first": 0, "hashes": [b"short"]},
        {"first": 0, "hashes": ["x" * 16]},
        {"first": 0, "hashes": [b"x" * 16] * (MAX_PREFIX_BLOCKS + 1)},
        {"first": MAX_PREFIX_BLOCKS - 1, "hashes": [b"x" * 16] * 2},
        {"first": 0, "hashes": [], "more": 1},
    ):
        with pytest.raises(ValueError):
            parse_prefix_keys({PREFIX_KEY: bad})


def test_hit_is_bounded_and_block_aligned():
    assert parse_prefix_hit({}, max_positions=64) == 0
    assert parse_prefix_hit({PREFIX_HIT_KEY: 32}, max_positions=64) == 32
    for bad in (-16, 80, 17, "16", True, 1.0):
        with pytest.raises(ValueError):
            parse_prefix_hit({PREFIX_HIT_KEY: bad}, max_positions=64)
