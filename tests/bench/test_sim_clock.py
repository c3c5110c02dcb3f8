"""The simulator's event core: time order, ties in scheduling order, cancellation, no scheduling into the past."""

from __future__ import annotations

import random

import pytest

from benchmarks.sim.clock import EventLoop


def test_events_run_in_time_order_and_ties_in_scheduling_order() -> None:
    loop, seen = EventLoop(), []
    loop.at(2.0, seen.append, "c")
    loop.at(1.0, seen.append, "a")
    loop.at(1.0, seen.append, "b")
    loop.after(0.5, seen.append, "first")
    loop.run(10.0)
    assert seen == ["first", "a", "b", "c"] and loop.now_s == 10.0 and loop.events_run == 4


def test_events_scheduled_while_running_and_the_horizon() -> None:
    loop, seen = EventLoop(), []

    def tick(n: int) -> None:
        seen.append((loop.now_s, n))
        loop.after(1.0, tick, n + 1)

    loop.at(0.0, tick, 0)
    loop.run(3.5)
    assert seen == [(0.0, 0), (1.0, 1), (2.0, 2), (3.0, 3)]
    assert loop.pending() == 1  # the tick at 4.0 waits for the next run
    loop.run(4.0)
    assert seen[-1] == (4.0, 4)


def test_a_cancelled_event_never_runs() -> None:
    loop, seen = EventLoop(), []
    event = loop.at(1.0, seen.append, "x")
    loop.at(2.0, seen.append, "y")
    event.cancel()
    loop.run(5.0)
    assert seen == ["y"] and loop.pending() == 0


def test_the_past_is_refused() -> None:
    loop = EventLoop()
    loop.run(5.0)
    with pytest.raises(ValueError, match="past"):
        loop.at(4.0, print)
    with pytest.raises(ValueError, match=">= 0"):
        loop.after(-1.0, print)


def _random_run(seed: int) -> list[tuple[float, int]]:
    rng, loop, seen = random.Random(seed), EventLoop(), []

    def event(n: int) -> None:
        seen.append((loop.now_s, n))
        if n < 200:
            loop.after(rng.choice([0.0, 0.5, rng.random()]), event, n + 1)
            if rng.random() < 0.3:
                loop.after(rng.random(), event, n + 1000)

    loop.at(0.0, event, 0)
    loop.run(1e9)
    return seen


def test_the_same_seed_gives_the_same_run() -> None:
    assert _random_run(7) == _random_run(7)
    assert _random_run(7) != _random_run(8)
