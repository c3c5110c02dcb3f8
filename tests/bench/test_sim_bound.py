"""The best-known placement search against brute force on a swarm small enough to enumerate (the max-flow it
maximizes: tests/unit/test_placement_flow.py)."""

from __future__ import annotations

import itertools
import math

import pytest

from benchmarks.sim.bound import ServerKind, best_known_placement, placed_flow


def _brute_force(kinds: list[ServerKind], counts: list[int], num_blocks: int) -> float:
    options = []
    for kind, count in zip(kinds, counts, strict=True):
        spans = [None] + [(s, s + k) for k in range(1, kind.max_blocks + 1) for s in range(num_blocks - k + 1)]
        options += [spans] * count
    return max(placed_flow(kinds, counts, list(choice), num_blocks) for choice in itertools.product(*options))


def test_best_known_matches_brute_force_on_a_tiny_swarm() -> None:
    # fewer blocks -> more tokens/s, as with KV memory left for bigger batches
    kinds = [ServerKind("big", (12.0, 5.0, 3.0)), ServerKind("small", (4.0, 1.5))]
    counts = [1, 2]
    exact = _brute_force(kinds, counts, 3)
    packed = best_known_placement(kinds, counts, 3, time_limit_s=0.0)
    assert packed.method == "stage-packing" and packed.flow_tps <= exact + 1e-6
    best = best_known_placement(kinds, counts, 3, time_limit_s=5.0)
    assert best.flow_tps == pytest.approx(exact, rel=1e-4)
    assert len(best.spans) == 3
    assert best.upper_bound_tps >= best.flow_tps - 1e-6 or math.isinf(best.upper_bound_tps)


def test_a_kind_refuses_more_blocks_than_it_holds() -> None:
    with pytest.raises(ValueError, match="1..2"):
        ServerKind("x", (1.0, 0.5)).capacity_at(3)
