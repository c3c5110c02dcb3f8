"""`Admission`, the ASGI middleware that bounds the generation requests `corolla-api` holds at once: in all (its
generation threads plus a bounded wait for one) and per client address. Past either bound a request is answered 429
with `Retry-After` before its body is read. Without it, a client opening 10,000 concurrent requests had each one
parsed and waiting in the thread pool's unbounded queue (its body, prompt ids and an asyncio task apiece) while 64 of
them held every generation thread.

The per-client bound counts by the client address uvicorn gives the request and leaves loopback addresses alone: the
gateway listens on 127.0.0.1 unless told otherwise, where the operator's own programs share one address; those are
bounded by the total only. A reverse proxy on the same machine that sends `X-Forwarded-For` has each of its clients
counted by its own address (uvicorn trusts that header from 127.0.0.1 and ::1 and rewrites the address before this
middleware); one on another machine is one address (64 requests for all its clients) unless uvicorn is told to trust
it (`FORWARDED_ALLOW_IPS=<its address>`) or `--max_requests_per_client` is raised."""

from __future__ import annotations

import ipaddress
from collections.abc import Callable
from typing import Any

from corolla.api.errors import ApiError
from corolla.utils.logging import get_logger

logger = get_logger(__name__)


def is_loopback(host: str) -> bool:
    """True for a loopback IP (IPv4-mapped IPv6 too); False for anything else, names and garbage included."""
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return address.is_loopback


class Admission:
    """ASGI middleware over `paths`: at most `max_in_flight` requests inside the app at once (a streaming one until
    its stream ends), at most `max_per_client` of them from one non-loopback client address; others get 429 with
    `Retry-After: retry_after_s`. One event loop runs it: the counters need no lock."""

    def __init__(
        self, app: Any, *, paths: tuple[str, ...], max_in_flight: int, max_per_client: int, retry_after_s: int
    ):
        if max_in_flight < 1 or max_per_client < 1 or retry_after_s < 0:
            raise ValueError(
                f"need max_in_flight >= 1, max_per_client >= 1, retry_after_s >= 0; got {max_in_flight}, "
                f"{max_per_client}, {retry_after_s}"
            )
        self.app, self.paths = app, paths
        self.max_in_flight, self.max_per_client, self.retry_after_s = max_in_flight, max_per_client, retry_after_s
        self.in_flight = 0
        self.per_client: dict[str, int] = {}

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http" or scope.get("path") not in self.paths:
            await self.app(scope, receive, send)
            return
        client = str((scope.get("client") or ("",))[0])
        counted = not is_loopback(client)
        refusal = None
        if self.in_flight >= self.max_in_flight:
            refusal = (
                f"The gateway holds {self.in_flight} generation requests, its limit "
                "(--max_concurrent_requests + --max_queued_requests); retry later"
            )
        elif counted and self.per_client.get(client, 0) >= self.max_per_client:
            refusal = (
                f"Your address has {self.max_per_client} generation requests running or waiting, its limit "
                "(--max_requests_per_client); retry when one has finished"
            )
        if refusal is not None:
            logger.info(f"api.request_rejected(reason=too_many_requests, client={client[:64]}, held={self.in_flight})")
            response = ApiError(429, refusal, type="rate_limit_error", code="rate_limit_exceeded").response()
            response.headers["Retry-After"] = str(self.retry_after_s)
            await response(scope, receive, send)
            return
        self.in_flight += 1
        if counted:
            self.per_client[client] = self.per_client.get(client, 0) + 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_flight -= 1
            if counted:
                left = self.per_client.pop(client) - 1
                if left:
                    self.per_client[client] = left
