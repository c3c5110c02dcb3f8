"""Decentralized placement on Helix's 24-node cluster: each node joins in turn and calls the real `choose_span` with
only the records of those already present. CorollaPolicy, knowing its tokens/s for each span length (fewer layers
leave more memory for KV), reaches >= 85% of Helix's centrally solved ILP layout; Petals' joins stay far below."""

from __future__ import annotations

import pytest

from benchmarks.sim import helix
from corolla.swarm.policy import ServerCapacity

SEEDS = range(10)


def test_corolla_sequential_joins_reach_85_percent_of_helix_ilp() -> None:
    flows = [helix.routed_max_flow(helix.sequential_joins("corolla", seed)) for seed in SEEDS]
    assert min(flows) >= 0.85 * helix.HELIX_BEST_FLOW_TPS  # >= 1096 tok/s in every join order
    for seed in SEEDS:  # every block is served, and each node holds a span its card can hold
        layout = helix.sequential_joins("corolla", seed)
        assert sorted({b for s, e in layout for b in range(s, e)}) == list(range(helix.NUM_BLOCKS))
        assert all(1 <= e - s <= kind.max_blocks for (s, e), kind in zip(layout, helix.NODE_KINDS, strict=True))


def test_corolla_fixed_join_orders_reach_it_too() -> None:
    nodes = list(range(len(helix.NODE_KINDS)))
    big_first = sorted(nodes, key=lambda n: -helix.NODE_KINDS[n].capacity_tps[0])
    for order in (nodes, big_first, big_first[::-1]):
        flow = helix.routed_max_flow(helix.sequential_joins("corolla", 0, order))
        assert flow >= 0.85 * helix.HELIX_BEST_FLOW_TPS
    with pytest.raises(ValueError, match="permutation"):
        helix.sequential_joins("corolla", 0, [0, 0])


def test_petals_sequential_joins_stay_far_below() -> None:
    corolla = min(helix.routed_max_flow(helix.sequential_joins("corolla", seed)) for seed in SEEDS)
    petals = [helix.routed_max_flow(helix.sequential_joins("petals", seed)) for seed in SEEDS]
    assert max(petals) < 0.85 * helix.HELIX_BEST_FLOW_TPS
    assert corolla >= 1.4 * max(petals)
    # Petals fills every card: the same layout lengths whatever the order
    layout = helix.sequential_joins("petals", 0)
    assert all(e - s == kind.max_blocks for (s, e), kind in zip(layout, helix.NODE_KINDS, strict=True))


def test_routed_flow_agrees_with_helix_on_its_ilp_layout() -> None:
    assert helix.routed_max_flow(helix.HELIX_ILP_LAYOUT) == pytest.approx(helix.HELIX_BEST_FLOW_TPS, rel=1e-3)


def test_capacity_curve_sets_throughput_per_span_length() -> None:
    me = ServerCapacity("me", 3, 1.0, network_rps=50.0, capacity_tps=(90.0, 40.0, 1.0))
    assert [me.throughput_for(k) for k in (1, 2, 3)] == [50.0, 40.0, 1.0]  # the link caps 90
    with pytest.raises(ValueError, match="capacity_tps"):
        ServerCapacity("me", 3, 1.0, capacity_tps=(2.0, 1.0))
    with pytest.raises(ValueError, match="capacity_tps"):
        ServerCapacity("me", 2, 1.0, capacity_tps=(float("nan"), 1.0))
