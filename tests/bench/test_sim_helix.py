"""The anchor: Helix's 24-node cluster (4x A100, 8x L4, 12x T4, LLaMA-2-70B) under Helix's capacity model, its Petals
layout within 10% of the 531.7 tok/s Helix reports, its ILP layout at 1289.6, and our best-known search above both."""

from __future__ import annotations

import pytest

from benchmarks.sim import helix
from benchmarks.sim.bound import best_known_placement
from corolla.swarm.placement_flow import placement_max_flow


def test_petals_layout_reproduces_helix_max_flow() -> None:
    flow = placement_max_flow(helix.PETALS_LAYOUT, helix.layout_capacities(helix.PETALS_LAYOUT), helix.NUM_BLOCKS)
    assert flow == pytest.approx(helix.PETALS_FLOW_TPS, rel=0.10)
    assert flow == pytest.approx(helix.PETALS_FLOW_TPS, rel=1e-3)  # in fact it is the same figure


def test_helix_ilp_layout_reproduces_its_incumbent() -> None:
    layout = helix.HELIX_ILP_LAYOUT
    flow = placement_max_flow(layout, helix.layout_capacities(layout), helix.NUM_BLOCKS)
    assert flow == pytest.approx(helix.HELIX_BEST_FLOW_TPS, rel=1e-3)


def test_cluster_composition() -> None:
    kinds, counts = helix.kind_counts()
    assert [k.name for k in kinds] == ["A100-40GB", "L4", "T4"] and counts == [4, 8, 12]
    assert [k.max_blocks for k in kinds] == [12, 7, 4]


def test_best_known_is_at_least_helix_incumbent() -> None:
    kinds, counts = helix.kind_counts()
    best = best_known_placement(kinds, counts, helix.NUM_BLOCKS, time_limit_s=0.0)
    assert best.flow_tps >= helix.HELIX_BEST_FLOW_TPS
    covered = sorted({b for s, e in best.spans for b in range(s, e)})
    assert covered == list(range(helix.NUM_BLOCKS))
