"""Every way the server refuses a request, as typed exceptions, and the one place (`rejection_reason`) that maps a
refusal to its `corolla_requests_rejected_total{reason}` label (the front counts and logs it). The error the client sees is the
exception's message (hivemind sends `str(error)` back over the stream), so the type decides the label and the text
is free to explain.

- `BadRequest` (ValueError): malformed or out-of-range input  -> bad_request
- `TooLong` (BadRequest): a length over a limit; carries the limit -> too_long
- `AllocationFailed` (utils.errors): no KV cache in time       -> cache_full (limits' own subclasses: their reason)
- `Overloaded` / `RuntimeStopped`: the device can't take work   -> overloaded
- `RequestTimeout` (TimeoutError): a deadline passed            -> timeout
- `Draining`: the server takes no new sessions          -> draining

A refusal crosses a handler channel (`protocol.channel_frames`) as (code, reason, value, limit, message) and is raised
again as the same type in the handler process (`encode_error` / `decode_error`)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from corolla.protocol.channel_frames import Reader, Writer
from corolla.server.core.executor import HandoffUnsupported
from corolla.server.core.limits import (
    DuplicateStep,
    LimitExceeded,
    PeerLimitExceeded,
    ServerLimitExceeded,
    SessionEvicted,
    StreamStalled,
)
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


# the REPLY_ERROR codes of the refusals that carry their message alone (`encode_error` gives them; 2, 4 and 5 carry
# a limit or a reason too, 0 is any other error)
MESSAGE_REFUSALS: dict[int, Callable[[str], Exception]] = {
    1: BadRequest,
    3: AllocationFailed,
    6: RequestTimeout,
    7: Overloaded,
    8: TypeError,
    9: HandoffUnsupported,
    10: Draining,
    11: SessionEvicted,
}


def encode_error(error: BaseException) -> Writer:
    """A refusal as a handler channel's REPLY_ERROR body: (code, reason, value, limit, message)."""
    code, reason, value, limit = 0, "", 0, 0
    if isinstance(error, TooLong):
        code, value, limit = 2, error.value, error.limit
    elif isinstance(error, HandoffUnsupported):
        code = 9
    elif isinstance(error, BadRequest):
        code = 1
    elif isinstance(error, (PeerLimitExceeded, ServerLimitExceeded)):
        code, reason = (4 if isinstance(error, PeerLimitExceeded) else 5), error.reason
    elif isinstance(error, SessionEvicted):
        code = 11
    elif isinstance(error, AllocationFailed):
        code = 3
    elif isinstance(error, (TimeoutError, asyncio.TimeoutError)):
        code = 6
    elif isinstance(error, (Overloaded, RuntimeStopped)):
        code = 7
    elif isinstance(error, TypeError):
        code = 8
    elif isinstance(error, Draining):
        code = 10
    elif isinstance(error, ValueError):
        code = 1
    return Writer().u8(code).text(reason).u64(max(0, value)).u64(max(0, limit)).text(str(error)[:4096])


def decode_error(reader: Reader) -> Exception:
    """The refusal of a REPLY_ERROR body, raised again as its type in the handler process (which counts and answers
    it exactly as in one process)."""
    code, reason, value, limit, message = reader.u8(), reader.text(), reader.u64(), reader.u64(), reader.text()
    if code == 2:
        return TooLong(message, value=value, limit=limit)
    if code in (4, 5):
        return (PeerLimitExceeded if code == 4 else ServerLimitExceeded)(message, reason=reason)
    return MESSAGE_REFUSALS.get(code, RuntimeError)(message)
