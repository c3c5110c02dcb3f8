"""A placement's max-flow through the swarm graph (`swarm.placement_flow`, the health monitor's bound) on
hand-checkable graphs."""

from __future__ import annotations

import pytest

from corolla.swarm.placement_flow import placement_max_flow


def test_a_chain_passes_its_weakest_server() -> None:
    assert placement_max_flow([(0, 2), (2, 4)], [10.0, 5.0], 4) == pytest.approx(5.0, rel=1e-6)


def test_parallel_chains_add_up_and_merge_at_shared_boundaries() -> None:
    spans = [(0, 2), (0, 2), (2, 4)]
    assert placement_max_flow(spans, [3.0, 4.0, 100.0], 4) == pytest.approx(7.0, rel=1e-6)
    assert placement_max_flow(spans, [3.0, 4.0, 5.0], 4) == pytest.approx(5.0, rel=1e-6)


def test_exact_boundaries_need_a_server_starting_where_another_ends() -> None:
    spans, caps = [(0, 3), (2, 4)], [10.0, 10.0]
    assert placement_max_flow(spans, caps, 4) == 0.0  # Helix's ILP: no server starts at block 3
    assert placement_max_flow(spans, caps, 4, exact_boundaries=False) == pytest.approx(10.0, rel=1e-6)


def test_gaps_and_bad_spans() -> None:
    assert placement_max_flow([(0, 2)], [10.0], 4) == 0.0
    assert placement_max_flow([], [], 4) == 0.0
    with pytest.raises(ValueError, match="inside"):
        placement_max_flow([(3, 5)], [1.0], 4)
