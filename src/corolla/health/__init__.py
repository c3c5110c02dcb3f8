"""Swarm health monitor (`corolla-health`): which servers hold which blocks of each model, and where the gaps are.

`state` (pure: DHT records -> the `/api/v1/state` document, shaped like health.petals.dev's), `collector` (a
client-mode DHT refreshed periodically in a thread), `static/index.html` (the self-refreshing page, no external
assets), `app` (`create_app`: the FastAPI app serving `/`, `/api/v1/state` and `/metrics`).
"""
