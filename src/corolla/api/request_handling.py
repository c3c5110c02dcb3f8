"""Request plumbing of `corolla-api` shared by its routes: the JSON body read within a byte limit (the declared
`Content-Length` refused up front, the body counted while it streams in, so an oversized request costs at most the
limit plus one chunk, never its size) and validated against the pydantic request model (unsupported parameters refused by name), validation errors worded as OpenAI
words them, generation failures mapped to OpenAI-style errors (`error_for`), and `RequestCounter`, the ASGI
middleware counting answers per route and HTTP status."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError

from corolla.api.errors import ApiError, invalid_param, missing_blocks
from corolla.api.metrics import ApiMetrics
from corolla.api.schemas import refuse_unsupported
from corolla.utils.errors import MissingBlocksError
from corolla.utils.logging import get_logger

logger = get_logger(__name__)

DEFAULT_MAX_REQUEST_BYTES = 1 << 20  # 1 MiB: a prompt of the largest context fits many times over


def _too_large(size: str, limit: int) -> ApiError:
    logger.info(f"api.request_rejected(reason=too_large, size={size}, limit={limit})")
    return ApiError(
        413,
        f"The request body is {size} bytes, more than the limit of {limit} bytes (--max_request_bytes)",
        code="request_too_large",
    )


async def read_body(request: Request, max_bytes: int) -> bytes:
    """The whole body, or ApiError 413 as soon as it is known to exceed `max_bytes` (400 for a bad length)."""
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.strip().isdigit():
            raise ApiError(400, "The Content-Length header must be a non-negative integer", code="invalid_request")
        if int(declared) > max_bytes:
            raise _too_large(declared.strip()[:20], max_bytes)
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > max_bytes:
            raise _too_large(f"over {max_bytes}", max_bytes)
    return bytes(body)


def error_for(exc: BaseException, model_id: str) -> ApiError:
    """The OpenAI-style error a generation failure is answered with: 400 (bad request), 503 (missing blocks), else 500."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, MissingBlocksError):
        return missing_blocks(model_id, exc.missing)
    if isinstance(exc, ValueError):
        return ApiError(400, str(exc))
    logger.error(f"api.generation_failed(error={exc!r})", exc_info=exc)
    return ApiError(500, f"generation failed: {type(exc).__name__}: {exc}", type="server_error")


def validation_message(err: ValidationError | RequestValidationError) -> tuple[str, str | None]:
    """(message, parameter) for the first validation error; an unknown field is named as unsupported."""
    first = err.errors()[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    msg = first.get("msg", "invalid request")
    if first.get("type") == "extra_forbidden":
        return f"Unsupported parameter '{param}': this server does not implement it (leave it out)", param
    return (f"Invalid value for '{param}': {msg}" if param else f"Invalid request: {msg}"), param


async def parse_body(
    request: Request, choose: Callable[[dict], type[BaseModel]], max_bytes: int, kind: str | None = None
) -> Any:
    """The body validated as the model `choose(body)` names; with `kind`, no-op fields dropped and unsupported ones
    refused first (`schemas.refuse_unsupported`)."""
    raw = await read_body(request, max_bytes)
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise ApiError(
            400, f"We could not parse the JSON body of your request ({e}); send valid JSON", code="invalid_json"
        ) from None
    if not isinstance(body, dict):
        raise ApiError(400, "The request body must be a JSON object", code="invalid_json")
    if kind is not None:
        body, param, why = refuse_unsupported(body, kind)
        if param is not None and why is not None:
            raise invalid_param(why, param, code="unsupported_parameter")
    try:
        return choose(body).model_validate(body)
    except ValidationError as e:
        message, param = validation_message(e)
        raise ApiError(400, message, param=param) from None


class RequestCounter:
    """ASGI middleware: counts each request to `paths` by the HTTP status it is answered with (streams: at start)."""

    def __init__(self, app: Any, *, metrics: ApiMetrics, paths: tuple[str, ...]):
        self.app, self.metrics, self.paths = app, metrics, paths

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        path = scope.get("path")
        if scope["type"] != "http" or path not in self.paths:
            await self.app(scope, receive, send)
            return

        async def counting_send(message: dict) -> None:
            if message["type"] == "http.response.start":
                self.metrics.request(path, message["status"])
            await send(message)

        await self.app(scope, receive, counting_send)
