"""The process's GIL switch interval (`sys.setswitchinterval`), one place that sets it.

A server runs two Python threads that matter: the serving loop (decodes, validates and encodes every session's
messages) and the runtime thread (launches each merged forward and waits for the device). A thread that wants the
GIL while the other runs Python waits up to the switch interval (CPython's default: 5 ms) before it may force a
hand-off. With many users the serving loop runs Python almost all the time, so every Python moment of the runtime
thread between two device waits can cost up to one interval. A shorter interval bounds that wait at the cost of
more hand-offs (each ~a few microseconds).

`configure_switch_interval` is an explicit choice (a server reads `COROLLA_GIL_SWITCH_INTERVAL_MS`, an experiment knob:
`switch_interval_from_env`, docs/decisions/0007); `lower_switch_interval` is a component's default (the fast path asks for 0.5 ms on a GPU server) and never overrides an explicit choice.
"""

from __future__ import annotations

import os
import sys
import threading

from corolla.utils.logging import get_logger

logger = get_logger(__name__)

# bounds of an explicit setting: below 10 us the interpreter spends its time handing the GIL back and forth; above
# 100 ms a waiting thread starves
MIN_SWITCH_INTERVAL_MS = 0.01
MAX_SWITCH_INTERVAL_MS = 100.0

_lock = threading.Lock()
_explicit_s: float | None = None  # set by `configure_switch_interval`; components then leave the interval alone


def check_switch_interval_ms(value_ms: float) -> float:
    """`value_ms` if it is a usable switch interval in milliseconds, else ValueError naming the bounds."""
    if not MIN_SWITCH_INTERVAL_MS <= value_ms <= MAX_SWITCH_INTERVAL_MS:
        raise ValueError(
            f"gil_switch_interval_ms must be in [{MIN_SWITCH_INTERVAL_MS}, {MAX_SWITCH_INTERVAL_MS}], got {value_ms}"
        )
    return value_ms


ENV_SWITCH_INTERVAL_MS = "COROLLA_GIL_SWITCH_INTERVAL_MS"


def switch_interval_from_env() -> float | None:
    """The interval in ms that `COROLLA_GIL_SWITCH_INTERVAL_MS` asks for (None: unset, components choose); ValueError
    for a value that is not a number within the bounds."""
    raw = os.environ.get(ENV_SWITCH_INTERVAL_MS)
    if raw is None or not raw.strip():
        return None
    try:
        value_ms = float(raw)
    except ValueError:
        raise ValueError(f"{ENV_SWITCH_INTERVAL_MS} must be a number of milliseconds, got {raw!r:.40}") from None
    return check_switch_interval_ms(value_ms)


def configure_switch_interval(value_ms: float) -> None:
    """Sets this process's switch interval to `value_ms` milliseconds, as the operator asked; later
    `lower_switch_interval` calls leave it as it is. ValueError outside the bounds."""
    global _explicit_s
    seconds = check_switch_interval_ms(value_ms) / 1000
    with _lock:
        _explicit_s = seconds
        sys.setswitchinterval(seconds)
    logger.info(f"gil.switch_interval(ms={value_ms}, source=explicit)")


def lower_switch_interval(seconds: float, *, reason: str) -> bool:
    """A component's default: lowers the switch interval to `seconds` unless the operator set one or it is already
    at most that. True if it changed."""
    with _lock:
        if _explicit_s is not None or sys.getswitchinterval() <= seconds:
            return False
        sys.setswitchinterval(seconds)
    logger.info(f"gil.switch_interval(ms={seconds * 1000:g}, source={reason})")
    return True


def explicit_switch_interval_s() -> float | None:
    """The operator's setting in seconds, None where none was made."""
    return _explicit_s
