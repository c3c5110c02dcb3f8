"""The device's view of its sessions' turn (`server.return_times.ReturnTimes`): a session's return is counted from
its step's result to its next step, only where both were seen; quantiles and the share within a limit read the
histogram; an ended session's pending result is dropped; channels merge and a window is a difference."""

from __future__ import annotations

import pytest

from corolla.server.handlers.return_times import BUCKET_S, NUM_BUCKETS, ReturnTimes


def test_a_return_is_counted_from_the_result_to_the_next_step_of_the_same_session() -> None:
    times = ReturnTimes()
    times.arrived(1, 10.0)  # no result before it: a first step is not a return
    assert times.count == 0
    times.done(1, 10.0)
    times.done(2, 10.0)
    times.arrived(1, 10.001225)  # 1.225 ms
    times.arrived(1, 10.0020)  # its result was not seen again: not counted twice
    assert times.count == 1
    assert times.quantile_s(0.5) == pytest.approx(1.25e-3)  # the 50 us bucket's upper edge
    times.arrived(2, 10.003125)
    assert times.count == 2
    assert times.quantile_s(1.0) == pytest.approx(3.15e-3)
    assert times.share_within(2e-3) == 0.5


def test_an_ended_session_is_forgotten_and_late_returns_land_in_the_overflow_bucket() -> None:
    times = ReturnTimes()
    times.done(7, 1.0)
    times.forget(7)
    times.arrived(7, 1.001)
    assert times.count == 0
    times.done(8, 1.0)
    times.arrived(8, 2.0)  # a second: past the histogram
    assert times.counts[NUM_BUCKETS] == 1
    assert times.quantile_s(0.5) == pytest.approx((NUM_BUCKETS + 1) * BUCKET_S)


def test_channels_merge_and_a_window_is_the_counts_since_its_start() -> None:
    a, b = ReturnTimes(), ReturnTimes()
    for handle, back in ((1, 0.0004), (2, 0.0009)):
        a.done(handle, 0.0)
        a.arrived(handle, back)
    start = ReturnTimes.merged([a, b]).counts
    b.done(3, 0.0)
    b.arrived(3, 0.005225)
    total = ReturnTimes.merged([a, b])
    assert total.count == 3
    window = total.minus(start)
    assert window.count == 1 and window.quantile_s(0.5) == pytest.approx(5.25e-3)


def test_bad_inputs_are_refused_with_the_limit() -> None:
    with pytest.raises(ValueError, match="401 buckets"):
        ReturnTimes([0] * 3)
    with pytest.raises(ValueError, match=r"\(0, 1\]"):
        ReturnTimes().quantile_s(0.0)
    assert ReturnTimes().quantile_s(0.5) is None and ReturnTimes().share_within(1.0) is None
