"""Every way the server refuses a request, as typed exceptions, each with its `reason`, and the one place
(`rejection_reason`) that maps a refusal to its `corolla_requests_rejected_total{reason}` label. The client sees the
exception's message (hivemind sends `str(error)`), so the type decides the label and the text is free to explain. A
refusal crosses a handler channel as a code and is raised again as its type there (`encode_error` / `decode_error`)."""

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


class RuntimeStopped(RuntimeError):
    """The runtime stopped before a pending task could run (the server shuts down)."""

    reason = "overloaded"


class Draining(RuntimeError):
    """The server is draining (shutting down or moving): it accepts no new sessions."""

    reason = "draining"


class RequestTimeout(TimeoutError):
    """The request or session did not finish within its deadline."""

    reason = "timeout"


# the typed refusals: each carries its own metrics label (`reason`)
REFUSALS = (
    LimitExceeded, SessionEvicted, StreamStalled, DuplicateStep, BadRequest, RuntimeStopped, Draining, RequestTimeout,
)  # fmt: skip


def rejection_reason(error: BaseException) -> str:
    """The metrics label of a refused request, from the error's type (never from its text)."""
    if isinstance(error, REFUSALS):
        return error.reason
    if isinstance(error, AllocationFailed):
        return "cache_full"
    if isinstance(error, (TimeoutError, asyncio.TimeoutError)):
        return "timeout"
    if isinstance(error, (ValueError, KeyError)):
        return "bad_request"
    return "other"


# a REPLY_ERROR's code by the refusal's type, the first that matches (0: any other error); TooLong carries its value
# and limit, the limits their reason
ERROR_CODES: tuple[tuple[int, type[BaseException] | tuple[type[BaseException], ...]], ...] = (
    (2, TooLong), (9, HandoffUnsupported), (1, BadRequest), (4, PeerLimitExceeded), (5, ServerLimitExceeded),
    (11, SessionEvicted), (3, AllocationFailed), (6, (TimeoutError, asyncio.TimeoutError)),
    (7, RuntimeStopped), (8, TypeError), (10, Draining), (1, ValueError),
)  # fmt: skip
# the codes whose refusal carries its message alone
MESSAGE_REFUSALS: dict[int, Callable[[str], Exception]] = {
    1: BadRequest, 3: AllocationFailed, 6: RequestTimeout, 7: RuntimeStopped, 8: TypeError, 9: HandoffUnsupported,
    10: Draining, 11: SessionEvicted,
}  # fmt: skip


def encode_error(error: BaseException) -> Writer:
    """A refusal as a handler channel's REPLY_ERROR body: (code, reason, value, limit, message)."""
    code = next((code for code, kind in ERROR_CODES if isinstance(error, kind)), 0)
    value, limit = (error.value, error.limit) if isinstance(error, TooLong) else (0, 0)
    reason = error.reason if isinstance(error, (PeerLimitExceeded, ServerLimitExceeded)) else ""
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
