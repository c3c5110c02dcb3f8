"""The chat page of `corolla-api` at `/` and its route endpoints.

- `GET /`, `GET /static/{chat.js,chat.css}`: the page, files shipped in `corolla/api/static/` (a fixed list: no
  path from the URL reaches the file system), under a Content-Security-Policy that allows nothing from outside this
  gateway (no inline script or style, no frames, no form posts elsewhere).
- `GET /corolla/route/{id}`: the route of one generation (id from the `x-corolla-route-id` response header of a
  completion request): state, steps run, and each server's peer id, block span, name and transport.
- `GET /corolla/route?limit=N`: the most recent generations, newest first (N <= `MAX_ROUTE_LIST`).
Both route endpoints need the API key when the gateway has one; the page itself holds no secret and does not.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from functools import cache
from importlib import resources
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response

from corolla.api.errors import ApiError
from corolla.api.route_trace import DEFAULT_ROUTE_LOG_ENTRIES, RouteLog, RouteTraceMiddleware

CONTENT_SECURITY_POLICY = (
    "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self'; "
    "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
PAGE_HEADERS = {
    "Content-Security-Policy": CONTENT_SECURITY_POLICY,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}
STATIC_FILES = {"chat.js": "text/javascript; charset=utf-8", "chat.css": "text/css; charset=utf-8"}
MAX_ROUTE_LIST = 64
_ROUTE_ID = re.compile(r"[0-9a-f]{32}")


@cache
def _static_text(name: str) -> str:
    return (resources.files("corolla.api") / "static" / name).read_text(encoding="utf-8")


def install_chat_page(
    app: FastAPI, check_auth: Callable[[Request], None], *, route_log_entries: int = DEFAULT_ROUTE_LOG_ENTRIES
) -> RouteLog:
    """Adds the page, its files, the route endpoints and the route-tracing middleware to the gateway `app`
    (`check_auth(request)` raises the gateway's 401). `route_log_entries=0` turns route tracking off."""
    route_log = RouteLog(route_log_entries)
    app.state.route_log = route_log
    app.add_middleware(RouteTraceMiddleware, route_log=route_log)

    @app.get("/", include_in_schema=False)
    async def chat_page() -> HTMLResponse:
        return HTMLResponse(_static_text("index.html"), headers=PAGE_HEADERS)

    @app.get("/static/{name}", include_in_schema=False)
    async def chat_static(name: str) -> Response:
        media_type = STATIC_FILES.get(name)
        if media_type is None:
            raise ApiError(404, "Not Found", code="not_found")
        return Response(_static_text(name), media_type=media_type, headers=PAGE_HEADERS)

    @app.get("/corolla/route/{route_id}")
    async def route_of(route_id: str, request: Request) -> JSONResponse:
        check_auth(request)
        trace = route_log.get(route_id) if _ROUTE_ID.fullmatch(route_id) else None
        if trace is None:
            raise ApiError(404, f"No generation with route id {route_id[:32]!r} is known", code="not_found")
        return JSONResponse(trace.to_dict(), headers={"Cache-Control": "no-store"})

    @app.get("/corolla/route")
    async def recent_routes(request: Request, limit: int = 8) -> dict[str, Any]:
        check_auth(request)
        if not 1 <= limit <= MAX_ROUTE_LIST:
            raise ApiError(400, f"limit must be in [1, {MAX_ROUTE_LIST}], got {limit}", param="limit")
        return {
            "route_log_entries": route_log.max_entries,
            "generations": [trace.to_dict() for trace in route_log.latest(limit)],
        }

    return route_log
