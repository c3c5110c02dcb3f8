"""The runtime's gather rule (`server.gather`): after a merged forward the device thread waits, at most a fraction of
that forward's time, for its sessions' next steps, so sessions that come back a little late still merge with the
others instead of alternating in cohorts; the wait is bounded, one slow session never holds the others, and while
the clients' round trip is longer than the budget (WAN) the rule does not wait at all. Its learned return time also
decides whether a launch waits for the forward in flight (`holds_launch`)."""

from __future__ import annotations

import asyncio
import time

import pytest

from corolla.server.core.gather import GatherRule, GatherSettings
from corolla.server.core.runtime import Runtime, Task, TaskQueue

pytestmark = pytest.mark.serial  # cohorts split or merge by a few ms of scheduling: the CPU to itself (a parallel
# `make test` under a docker build once merged the "without the rule" cohorts in 4 of 16 rounds)

KIND = "merged"
FORWARD_S = 0.04  # each merged forward sleeps this long on the device thread (long enough that scheduling jitter
# of a loaded 2-core CI machine stays small beside the 8 ms lateness below)


def _runtime(fraction: float, sizes: list[int]) -> Runtime:
    runtime = Runtime(max_batch_size_tokens=1024, gather=GatherSettings(fraction=fraction))

    def execute(tasks: list[Task]) -> list[object]:
        sizes.append(len(tasks))
        time.sleep(FORWARD_S)
        return [task.payload for task in tasks]

    runtime.register_batch_executor(KIND, execute)
    return runtime


async def _session(runtime: Runtime, index: int, steps: int, think_s: float, ends: list[float]) -> None:
    """One session: a step, then `think_s` (its client's round trip), then the next step."""
    for step in range(steps):
        result = await runtime.submit(
            lambda: None, priority=1.0, size_tokens=1, kind=KIND, merge_key="k", payload=step, sessions=(index,)
        )
        assert result == step
        await asyncio.sleep(think_s)
    ends.append(time.monotonic())


async def _drive(fraction: float, think_s: list[float], steps: int) -> tuple[list[int], list[float], float]:
    sizes: list[int] = []
    ends: list[float] = []
    with _runtime(fraction, sizes) as runtime:
        started = time.monotonic()
        await asyncio.wait_for(
            asyncio.gather(*(_session(runtime, i, steps, t, ends) for i, t in enumerate(think_s))), 30
        )
    return sizes, [end - started for end in ends], started


async def test_late_sessions_merge_with_the_others_instead_of_alternating() -> None:
    # 8 sessions: half come back at once, half 8 ms later (a fifth of the forward): without the rule they split
    think = [0.0, 0.008] * 4
    with_rule, _, _ = await _drive(0.5, think, steps=8)
    without, _, _ = await _drive(0.0, think, steps=8)
    assert sum(with_rule) == sum(without) == 8 * 8
    assert len(with_rule) <= 10, with_rule  # ~one forward per round (the first rounds may learn)
    # two cohorts alternate (16 forwards when apart; a loaded host merges a round now and then: 13 seen on 2 cores)
    assert len(without) >= 12, without


async def test_a_slow_session_does_not_stall_the_others() -> None:
    # 7 sessions return at once; one's client takes 400 ms (10 forwards) per round trip
    steps = 8
    _, ends, _ = await _drive(0.5, [0.0] * 7 + [0.4], steps=steps)
    fast = sorted(ends)[:7]
    # each fast round: one forward plus at most the bounded wait (half a forward) plus scheduling slack
    assert max(fast) < steps * FORWARD_S * 1.5 + 0.15, fast


def test_the_wait_is_bounded_by_the_forward_and_skipped_for_slow_round_trips() -> None:
    rule = GatherRule(GatherSettings(fraction=0.5, quantile=0.875))
    assert rule.finished(size=8, forward_s=0.010, now_s=100.0, num_pushed=50) == 7
    wait = rule.wait(100.001, num_pushed=52)
    assert wait is not None and wait.num_pushed == 50 + 7 and wait.timeout_s == pytest.approx(0.004)
    assert rule.wait(100.006, num_pushed=52) is None  # the budget (5 ms after the forward) is spent
    assert rule.wait(100.001, num_pushed=57) is None  # 7 of 8 are back: nothing to wait for
    # the clients take 30 ms to come back (WAN): learned at the next forward's end, then no more waiting
    rule.learn([(100.0, 100.030)], None)
    rule.finished(size=8, forward_s=0.010, now_s=100.040, num_pushed=60)
    assert rule.return_s == pytest.approx(0.020)  # counted as two forwards: "later than a forward" to both decisions
    assert rule.wait(100.041, num_pushed=60) is None and rule.num_skipped == 1
    # a lone step (size 1) opens no cohort; a disabled rule never waits
    assert rule.finished(size=1, forward_s=0.010, now_s=101.0, num_pushed=70) is None
    assert rule.wait(101.001, num_pushed=70) is None
    off = GatherRule(GatherSettings(fraction=0.0))
    off.finished(size=8, forward_s=0.010, now_s=100.0, num_pushed=50)
    assert off.wait(100.001, num_pushed=50) is None
    with pytest.raises(ValueError, match="fraction"):
        GatherSettings(fraction=1.5)


def test_a_launch_is_held_only_while_sessions_come_back_within_a_forward() -> None:
    rule = GatherRule(GatherSettings(fraction=0.5, quantile=0.5))
    assert not rule.holds_launch()  # nothing learned yet
    rule.finished(size=4, forward_s=0.005, now_s=1.0, num_pushed=0)
    assert not rule.holds_launch()  # a forward's length, no return time yet
    rule.learn([(1.0, 1.002)], None)
    rule.finished(size=4, forward_s=0.005, now_s=1.007, num_pushed=2)
    assert rule.return_s == pytest.approx(0.002) and rule.holds_launch()  # back in 2 ms, forwards of 5 ms (32 layers)
    rule.learn([], 0.003)  # a forward never came back while it was watched: at least 3 ms: raised to 2.2 ms
    rule.finished(size=4, forward_s=0.0015, now_s=1.010, num_pushed=2)
    assert not rule.holds_launch()  # forwards of 1.5 ms (8 layers): sessions come back after it, launch at once
    off = GatherRule(GatherSettings(fraction=0.0))
    off.return_s, off.forward_s = 0.002, None
    off.finished(size=4, forward_s=0.005, now_s=1.0, num_pushed=0)
    assert not off.holds_launch()  # the rule off: never held


def test_a_forwards_return_counts_its_own_sessions_not_the_late_ones_of_the_forward_before() -> None:
    """Two cohorts of 8 sessions launched behind each other (forwards of 1.5 ms, 8 layers on an H200), each session
    back 3 ms after its forward: the late sessions of the forward before arrive after this one finished. Counted as
    this one's (as any push after it was), the return read 1.0 ms (the rule before, in this scenario), shorter than a
    forward, and the launch was held (then, held, the true return showed and it launched at once again: it flipped
    every few forwards)."""
    rule, queue = GatherRule(GatherSettings()), TaskQueue()
    forward_s, return_s = 0.0015, 0.003
    events = [(k * forward_s, "finished", k) for k in range(40)]
    events += [(k * forward_s + return_s, "back", k) for k in range(40)]
    for at_s, what, k in sorted(events):
        sessions = range(8 * (k % 2), 8 * (k % 2) + 8)
        if what == "finished":
            rule.learn(*queue.take_returns())
            count = rule.finished(size=8, forward_s=forward_s, now_s=at_s, num_pushed=queue.num_pushed)
            assert count == 7
            queue.watch(set(sessions), count, at_s)
        else:
            for session in sessions:
                queue.push(Task(lambda: None, 1.0, 1, None, None, KIND, "k", submitted_at=at_s, sessions=(session,)))
    assert rule.return_s == pytest.approx(return_s, rel=0.05)
    assert not rule.holds_launch()


def test_a_pause_between_turns_does_not_keep_the_launch_from_being_held() -> None:
    """Sessions that come back in 2 ms after forwards of 5 ms (32 layers), then a pause: their next steps arrive 10 s
    later (users reading; a benchmark's gap between rows; prefilled sessions waiting for their first token). Learned
    as it was, the pause made the return read as seconds and the launch went unheld for ~40 forwards (0.8 ** 40 * 10 s
    = 1.3 ms) while the turns were 2 ms again; counted as at most two forwards, the rule holds again within a few."""
    rule = GatherRule(GatherSettings())
    now_s = 0.0
    for _ in range(5):
        rule.finished(size=32, forward_s=0.005, now_s=now_s, num_pushed=0)
        rule.learn([(now_s, now_s + 0.002)], None)
        now_s += 0.007
    assert rule.holds_launch()
    rule.learn([(now_s, now_s + 10.0)], None)  # the pause
    rule.learn([], 12.0)  # and a forward of the pause's last turn never seen back (dropped by the queue)
    now_s += 10.0
    held_after = None
    for k in range(40):
        rule.finished(size=32, forward_s=0.005, now_s=now_s, num_pushed=0)
        if rule.holds_launch():
            held_after = k
            break
        rule.learn([(now_s, now_s + 0.002)], None)
        now_s += 0.007
    assert held_after is not None and held_after <= 5, held_after
