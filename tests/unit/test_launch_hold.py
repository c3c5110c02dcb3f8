"""The launch hold's arithmetic (`server.launch_hold.LaunchHold`): no hold before a forward's device time and a
launch's host time are known, or when disabled; the hold ends the learned launch time, wake-up delay and margin
before the running forward's expected end (which starts when the one before it finished or its own launch returned,
whichever is later); it never exceeds its share of a forward; a timed wait that woke late teaches the delay, one
woken early does not; settings out of bounds are refused."""

from __future__ import annotations

import pytest

from corolla.server.launch_hold import HoldSettings, LaunchHold


def _learned(margin_s: float = 0.0) -> LaunchHold:
    hold = LaunchHold(HoldSettings(margin_s=margin_s))
    hold.finished(0.0015)  # forwards of 1.5 ms on the device
    hold.launched(0.0003)  # a pop and launch take 0.3 ms
    return hold


def test_no_hold_before_anything_is_learned_or_when_disabled() -> None:
    hold = LaunchHold()
    assert hold.hold_s(now_s=1.0, previous_done_s=1.0, running_launched_s=1.0) == 0.0
    hold.finished(None)  # a launcher without device times (CPU)
    hold.launched(0.0003)
    assert hold.forward_s is None and hold.hold_s(now_s=1.0, previous_done_s=1.0, running_launched_s=1.0) == 0.0
    off = LaunchHold(HoldSettings(enabled=False))
    off.finished(0.0015)
    off.launched(0.0003)
    assert off.hold_s(now_s=1.0, previous_done_s=1.0, running_launched_s=1.0) == 0.0


def test_the_hold_ends_the_launch_time_and_margin_before_the_running_forwards_expected_end() -> None:
    hold = _learned(margin_s=0.0001)
    # the forward before ended at 10.0 (the running one was queued behind it): end 10.0015, pop by 10.0011
    assert hold.hold_s(now_s=10.0002, previous_done_s=10.0, running_launched_s=9.9995) == pytest.approx(0.0009)
    # launched onto an idle device at 10.0004: its end is 10.0019
    assert hold.hold_s(now_s=10.0006, previous_done_s=9.0, running_launched_s=10.0004) == pytest.approx(0.0009)
    # too late to hold at all
    assert hold.hold_s(now_s=10.0013, previous_done_s=10.0, running_launched_s=9.9995) == 0.0


def test_the_hold_is_capped_at_its_share_of_a_forward() -> None:
    hold = LaunchHold(HoldSettings(margin_s=0.0, max_fraction=0.5))
    hold.finished(0.0015)
    hold.launched(0.0)
    assert hold.hold_s(now_s=10.0, previous_done_s=10.0, running_launched_s=10.0) == pytest.approx(0.00075)


def test_a_late_wake_up_is_learned_and_an_early_one_is_not() -> None:
    hold = _learned()
    hold.woke(0.0008, 0.0010)  # woke 0.2 ms late
    assert hold.late_s == pytest.approx(0.0002)
    hold.woke(0.0008, 0.0001)  # woken early (a stop or a wake-up): not a delay
    assert hold.late_s == pytest.approx(0.0002)
    assert hold.num_holds == 2 and hold.held_s == pytest.approx(0.0011)
    # the next hold ends that much earlier: 10.0015 - 0.3 ms launch - 0.2 ms delay
    assert hold.hold_s(now_s=10.0, previous_done_s=10.0, running_launched_s=10.0) == pytest.approx(0.001)


def test_settings_out_of_bounds_are_refused() -> None:
    with pytest.raises(ValueError, match=r"\[0, 0.01\] s"):
        HoldSettings(margin_s=0.5)
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        HoldSettings(max_fraction=1.5)
