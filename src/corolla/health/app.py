"""The monitor's FastAPI app: `/` (the page, `static/index.html`: no external assets; it renders everything from
`/api/v1/state`, so the page and the API never disagree), `/api/v1/state` (JSON, see `corolla.health.state`) and
`/metrics` (Prometheus gauges of the swarm: servers and blocks online per model)."""

from __future__ import annotations

from functools import cache
from importlib import resources
from typing import Any

from fastapi import FastAPI
from fastapi.responses import HTMLResponse, JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Gauge, generate_latest

from corolla.health.collector import StateCollector


@cache
def _page_html() -> str:
    return resources.files("corolla.health").joinpath("static/index.html").read_text(encoding="utf-8")


def _metrics_text(state: dict[str, Any]) -> bytes:
    registry = CollectorRegistry()
    servers = Gauge("corolla_swarm_servers", "Servers by model and state", ["model", "state"], registry=registry)
    blocks = Gauge("corolla_swarm_blocks", "Blocks by model and coverage state", ["model", "state"], registry=registry)
    healthy = Gauge(
        "corolla_swarm_model_healthy", "1 if every block has an online server", ["model"], registry=registry
    )
    for report in state["model_reports"]:
        model = report["dht_prefix"]
        for s in ("online", "joining", "offline", "unreachable"):
            servers.labels(model=model, state=s).set(sum(1 for r in report["server_rows"] if r["state"] == s))
        for s in ("online", "joining", "gap"):
            blocks.labels(model=model, state=s).set(sum(1 for b in report["blocks"] if b["state"] == s))
        healthy.labels(model=model).set(1 if report["state"] == "healthy" else 0)
    return generate_latest(registry)


def create_app(collector: StateCollector) -> FastAPI:
    app = FastAPI(title="corolla swarm health")

    @app.get("/", response_class=HTMLResponse)
    async def page() -> HTMLResponse:
        return HTMLResponse(_page_html(), headers={"Cache-Control": "no-store"})

    @app.get("/api/v1/state")
    async def state() -> JSONResponse:
        return JSONResponse(collector.state, headers={"Cache-Control": "no-store"})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(_metrics_text(collector.state), media_type=CONTENT_TYPE_LATEST)

    return app
