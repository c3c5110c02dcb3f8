"""Every way the server refuses a request, as typed exceptions, and the one place (`rejection_reason`) that maps a
refusal to its `corolla_requests_rejected_total{reason}` label (the front counts and logs it). The error the client sees is the
exception's message (hivemind sends `str(error)` back over the stream), so the type decides the label and the text
is free to explain.

- `BadRequest` (ValueError): malformed or out-of-range input  -> bad_request
- `TooLong` (BadRequest): a length over a limit; carries the limit -> too_long
- `AllocationFailed` (utils.errors): no KV cache in time       -> cache_full (limits' own subclasses: their reason)
- `Overloaded` / `RuntimeStopped`: the device can't take work   -> overloaded
- `RequestTimeout` (TimeoutError): a deadline passed            -> timeout
- `Draining`: the server takes no new sessions          -> draining"""

from __future__ import annotations

import asyncio

from corolla.server.core.limits import DuplicateStep, LimitExceeded, SessionEvicted, StreamStalled
from corolla.utils.errors import AllocationFailed


class BadRequest(ValueError):
    """The request is malformed or out of range (shapes, dtypes, values, uids, metadata)."""

    reason = "bad_request"


class TooLong(BadRequest):
    """A length (`what`) of `value` tokens is over `limit`."""

    reason = "too_long"

    def __init__(self, message: str, *, value: int, limit: int):
        super().__init__(message)
        self.value = value
        self.limit = limit


class Overloaded(RuntimeError):
    """The server can't take this work now (its device queue is closed or full)."""

    reason = "overloaded"


class RuntimeStopped(RuntimeError):
    """The runtime stopped before a pending task could run (the server shuts down)."""

    reason = "overloaded"


class Draining(RuntimeError):
    """The server is draining (shutting down or moving): it accepts no new sessions."""

    reason = "draining"


class RequestTimeout(TimeoutError):
    """The request or session did not finish within its deadline."""

    reason = "timeout"


def rejection_reason(error: BaseException) -> str:
    """The metrics label of a refused request, from the error's type (never from its text)."""
    if isinstance(error, (LimitExceeded, SessionEvicted, StreamStalled, DuplicateStep)):
        return error.reason
    if isinstance(error, AllocationFailed):
        return "cache_full"
    if isinstance(error, (TimeoutError, asyncio.TimeoutError)):
        return "timeout"
    if isinstance(error, (Overloaded, RuntimeStopped)):
        return "overloaded"
    if isinstance(error, Draining):
        return "draining"
    if isinstance(error, TooLong):
        return "too_long"
    if isinstance(error, (ValueError, KeyError)):
        return "bad_request"
    return "other"
