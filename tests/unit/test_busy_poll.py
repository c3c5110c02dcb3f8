"""BusyPollSelector: sleeps like the default selector unless hot; while hot it picks events up by polling; `cool`
ends that at once; `run` is asyncio.run on that selector (leftover tasks cancelled)."""

from __future__ import annotations

import asyncio
import selectors
import socket
import threading
import time

import pytest

from corolla.utils import busy_poll
from corolla.utils.busy_poll import BusyPollSelector


@pytest.fixture
def polled():
    """(selector, sender, receiver): a socket pair whose receiving end the selector watches."""
    selector = BusyPollSelector()
    sender, receiver = socket.socketpair()
    selector.register(receiver, selectors.EVENT_READ)
    yield selector, sender, receiver
    selector.close()
    sender.close()
    receiver.close()


def test_not_hot_blocks_and_honours_the_timeout(polled) -> None:
    selector, a, _ = polled
    started = time.monotonic()
    assert selector.select(0.05) == []
    assert time.monotonic() - started >= 0.04
    a.send(b"x")
    assert len(selector.select(1)) == 1 and selector.polled_events == 0


def test_hot_selector_polls_an_event_that_arrives_later(polled) -> None:
    selector, a, b = polled
    selector.keep_hot(1.0)
    threading.Timer(0.02, a.send, args=(b"x",)).start()
    events = selector.select(None)
    assert len(events) == 1 and selector.polled_events == 1
    b.recv(1)
    # hot period over: back to blocking (the timeout is still honoured, nothing polled)
    selector._hot_until = 0.0
    assert selector.select(0.01) == [] and selector.polled_events == 1


def test_cool_stops_polling_at_once(polled) -> None:
    selector, _, _ = polled
    selector.keep_hot(60.0)
    selector.cool()
    started = time.monotonic()
    assert selector.select(0.02) == [] and selector.polled_events == 0
    assert time.monotonic() - started < 1


def test_run_returns_the_result_and_cancels_leftover_tasks() -> None:
    cancelled = []

    async def leftover() -> None:
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            cancelled.append(True)
            raise

    async def main() -> int:
        asyncio.get_running_loop().create_task(leftover())
        await asyncio.sleep(0)
        return 7

    selector = BusyPollSelector()
    assert busy_poll.run(main(), selector) == 7
    assert cancelled == [True]
    assert busy_poll.run(main()) == 7


def test_a_lingering_selector_polls_after_each_event_and_sleeps_once_the_linger_passed() -> None:
    selector = BusyPollSelector(linger_s=0.5)
    a, b = socket.socketpair()
    selector.register(b, selectors.EVENT_READ)
    try:
        assert selector.select(0.01) == []  # nothing came yet: not hot, it slept
        a.send(b"x")
        assert len(selector.select(1)) == 1 and selector.polled_events == 0  # woke from sleep
        b.recv(1)
        threading.Timer(0.02, a.send, args=(b"y",)).start()
        assert len(selector.select(None)) == 1 and selector.polled_events == 1  # within the linger: polled
        b.recv(1)
        selector._hot_until = time.monotonic()  # the linger passed without a message
        assert selector.select(0.01) == [] and selector.polled_events == 1  # back to sleeping
    finally:
        selector.close()
        a.close()
        b.close()


def test_a_linger_outside_its_bounds_is_refused() -> None:
    with pytest.raises(ValueError, match=r"\[0, 1\] s"):
        BusyPollSelector(linger_s=2.0)
