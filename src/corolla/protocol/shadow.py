"""The shadow-session mark (corolla <-> corolla; stock Petals peers ignore it): `SHADOW_KEY: True` in the first
request of an `rpc_inference` stream makes it a client's mirror of another server's session (`client.session.shadows`),
recomputed here so that the client compares; a corolla server ranks its steps behind real ones (`Task.lead_after`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

SHADOW_KEY = "corolla.shadow"  # first request metadata: True (absent: a real session)


def parse_shadow(extra: Mapping[str, Any]) -> bool:
    """Whether an opening request's metadata extensions mark a shadow session; ValueError for any value but a bool."""
    value = extra.get(SHADOW_KEY, False)
    if not isinstance(value, bool):
        raise ValueError(f"{SHADOW_KEY} must be a bool, got {type(value).__name__}")
    return value
