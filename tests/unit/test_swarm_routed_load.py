"""A client's recently routed sessions: counted per server, halved every half-life, forgotten once faded."""

from __future__ import annotations

import pytest

from corolla.swarm.routed_load import RoutedLoad


def test_counts_decay_and_fade() -> None:
    routed = RoutedLoad(half_life_s=10.0)
    assert routed.load(0.0) == {}
    routed.note(["a", "b"], 0.0)
    routed.note(["a"], 0.0)
    assert routed.load(0.0) == {"a": 2.0, "b": 1.0}
    assert routed.load(10.0) == pytest.approx({"a": 1.0, "b": 0.5})
    routed.note(["b"], 10.0)  # decayed count + 1, aged from now
    assert routed.load(20.0) == pytest.approx({"a": 0.5, "b": 0.75})
    routed.note(["c"], 100.0)  # a and b have faded below 0.01 sessions: forgotten
    assert routed.load(100.0) == {"c": 1.0}


def test_bad_half_life() -> None:
    with pytest.raises(ValueError, match="half_life_s"):
        RoutedLoad(half_life_s=0.0)
