"""Prefix caching in benchmarks.sim: a server's cache model (whole blocks, LRU in tokens, per span) and the scenario
(stateless turns): without the cache nothing is reused; with it later turns reuse most of their conversation and
reach their first token sooner; cache-affine routing sends turns back to the chain that held them."""

from __future__ import annotations

import pytest

from benchmarks.prefix.sim_cache import ServerPrefixCache
from benchmarks.prefix.sim_scenario import compare, prefix_config
from benchmarks.sim.scenarios import scenario


def test_the_cache_keeps_whole_blocks_per_span_and_forgets_the_least_recently_used() -> None:
    cache = ServerPrefixCache(capacity_tokens=100)
    cache.store(1, 0, 4, 40)  # 2 whole blocks
    assert cache.hit(1, 0, 4) == 32 and cache.hit(1, 0, 3) == 0 and cache.hit(2, 0, 4) == 0
    cache.store(2, 0, 4, 48)
    assert cache.hit(1, 0, 4) == 32  # conversation 1 is now the most recently used
    cache.store(3, 0, 4, 32)  # 32 + 48 + 32 > 100: conversation 2 goes
    assert (cache.hit(2, 0, 4), cache.hit(1, 0, 4), cache.hit(3, 0, 4)) == (0, 32, 32)
    assert cache.evictions == 1 and cache.cached_tokens == 64
    cache.store(1, 0, 4, 80)  # the next turn replaces its conversation's entry: 80 + 32 > 100, conversation 3 goes
    assert (cache.hit(1, 0, 4), cache.hit(3, 0, 4), cache.cached_tokens, cache.evictions) == (80, 0, 80, 2)
    cache.store(4, 0, 4, 500)  # larger than the whole cache: not kept
    assert cache.hit(4, 0, 4) == 0
    with pytest.raises(ValueError):
        ServerPrefixCache(-1)


def test_stateless_turns_reuse_their_conversation_with_the_cache() -> None:
    results = compare(prefix_config(scenario("tiny", policy="petals"), duration_s=1200.0), 16384)
    off, plain, affine = results["no cache"], results["cache, plain routing"], results["cache, affine routing"]
    assert off["reused_tokens"] == 0 and off["later_turns"] > 20
    for on in (plain, affine):
        assert on["saved_prefill"] > 0.5 and on["failed"] == 0
        assert on["later_ttft_p50_s"] < 0.5 * off["later_ttft_p50_s"]
    assert plain["affine_routes"] == 0 and affine["affine_routes"] > 0.8 * affine["later_turns"]
