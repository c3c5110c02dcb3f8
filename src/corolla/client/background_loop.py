"""One asyncio event loop per process, in a daemon thread, that runs all client networking (P2P replica, stubs)
so that synchronous torch code can call remote servers."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

from corolla.utils.busy_poll import BusyPollSelector
from corolla.utils.interrupts import future_result

T = TypeVar("T")

_lock = threading.Lock()
_loop: asyncio.AbstractEventLoop | None = None
_selector: BusyPollSelector | None = None


def get_loop() -> asyncio.AbstractEventLoop:
    """Starts the loop thread on first use."""
    global _loop, _selector
    with _lock:
        if _loop is None or _loop.is_closed():
            _selector = BusyPollSelector()  # sleeps unless a session polls for a due response (busy_poll_ms)
            loop = asyncio.SelectorEventLoop(_selector)
            ready = threading.Event()

            def _run() -> None:
                asyncio.set_event_loop(loop)
                loop.call_soon(ready.set)
                loop.run_forever()

            threading.Thread(target=_run, name="corolla-client-loop", daemon=True).start()
            ready.wait()
            _loop = loop
        return _loop


def get_selector() -> BusyPollSelector:
    """The loop's selector (to poll for an inference response instead of sleeping; see ClientConfig.busy_poll_ms)."""
    get_loop()
    assert _selector is not None
    return _selector


def on_loop() -> bool:
    """Whether the caller runs on the client loop (which must never block on itself: `run`)."""
    try:
        return asyncio.get_running_loop() is get_loop()
    except RuntimeError:
        return False


def run(coro: Coroutine[Any, Any, T], timeout_s: float | None = None) -> T:
    """Runs `coro` on the loop thread and waits for its result (must not be called from the loop thread)."""
    assert not on_loop(), "blocking on the client loop from inside it would deadlock"
    future = asyncio.run_coroutine_threadsafe(coro, get_loop())
    try:
        return future_result(future, timeout_s)  # in slices: Ctrl-C ends the wait (utils.interrupts)
    except concurrent.futures.TimeoutError:
        if future.done():  # the coroutine raised a TimeoutError itself
            raise
        future.cancel()
        raise TimeoutError(f"client call did not finish within {timeout_s} s") from None
    except BaseException:  # Ctrl-C (KeyboardInterrupt) while waiting: the call stops too, no retries behind our back
        future.cancel()
        raise
