"""BusyPollSelector: sleeps like the default selector unless hot; while hot it picks events up by polling; `cool`
ends that at once; `run` is asyncio.run on that selector (leftover tasks cancelled)."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

from corolla.utils import busy_poll
from corolla.utils.busy_poll import BusyPollSelector


def _pair_with_selector(selector: BusyPollSelector):
    a, b = socket.socketpair()
    selector.register(b, 1)  # EVENT_READ
    return a, b


def test_not_hot_blocks_and_honours_the_timeout() -> None:
    selector = BusyPollSelector()
    a, b = _pair_with_selector(selector)
    try:
        started = time.monotonic()
        assert selector.select(0.05) == []
        assert time.monotonic() - started >= 0.04
        a.send(b"x")
        assert len(selector.select(1)) == 1 and selector.polled_events == 0
    finally:
        selector.close()
        a.close()
        b.close()


def test_hot_selector_polls_an_event_that_arrives_later() -> None:
    selector = BusyPollSelector()
    a, b = _pair_with_selector(selector)
    try:
        selector.keep_hot(1.0)
        threading.Timer(0.02, a.send, args=(b"x",)).start()
        events = selector.select(None)
        assert len(events) == 1 and selector.polled_events == 1
        b.recv(1)
        # hot period over: back to blocking (the timeout is still honoured, nothing polled)
        selector._hot_until = 0.0
        assert selector.select(0.01) == [] and selector.polled_events == 1
    finally:
        selector.close()
        a.close()
        b.close()


def test_cool_stops_polling_at_once() -> None:
    selector = BusyPollSelector()
    a, b = _pair_with_selector(selector)
    try:
        selector.keep_hot(60.0)
        selector.cool()
        started = time.monotonic()
        assert selector.select(0.02) == [] and selector.polled_events == 0
        assert time.monotonic() - started < 1
    finally:
        selector.close()
        a.close()
        b.close()


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
