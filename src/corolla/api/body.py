"""Reading a request body within a byte limit: the declared `Content-Length` is refused up front, and the body is
counted while it streams in, so an oversized request costs at most the limit (plus one chunk), never its size."""

from __future__ import annotations

from fastapi import Request

from corolla.api.errors import ApiError
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
