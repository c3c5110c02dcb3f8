"""`LaunchTiming` (server.launch_timing): when the runtime launches the batch behind a running one."""

from __future__ import annotations

import pytest

from corolla.server.launch_timing import MARGIN_S, MAX_HOLD_S, LaunchTiming


def test_nothing_learned_means_at_once() -> None:
    timing = LaunchTiming()
    assert timing.launch_at(10.0) is None
    timing.launched(0.0005)
    assert timing.launch_at(10.0) is None  # no device time yet
    timing.ran(None)  # a launcher that does not time its batches teaches nothing
    assert timing.launch_at(10.0) is None


def test_launch_just_before_the_expected_end() -> None:
    timing = LaunchTiming()
    timing.launched(0.0005)
    timing.ran(0.0014)
    # the running batch's device work started at 10.0: launch at its expected end less the launch and a margin
    assert timing.launch_at(10.0) == pytest.approx(10.0 + 0.0014 - 0.0005 - MARGIN_S)


def test_the_hold_is_bounded_both_ways() -> None:
    timing = LaunchTiming()
    timing.launched(0.002)
    timing.ran(0.001)  # launching takes longer than the device's work: at once
    assert timing.launch_at(10.0) == pytest.approx(10.0)
    timing = LaunchTiming()
    timing.launched(0.0001)
    timing.ran(5.0)  # a wrong estimate never holds the device for long
    assert timing.launch_at(10.0) == pytest.approx(10.0 + MAX_HOLD_S)


def test_the_estimate_follows_the_device_not_the_hold() -> None:
    """Only the device's own timing is learned (an average moving towards each new figure): a host clock would count
    the runtime's hold in, and every hold would lengthen the next one."""
    timing = LaunchTiming()
    timing.launched(0.0005)
    timing.ran(0.010)
    for _ in range(40):
        timing.ran(0.0014)
    assert timing.device_s == pytest.approx(0.0014, rel=0.01)
