"""The shadow-session mark (corolla <-> corolla; stock Petals peers ignore it): the first request of an
`rpc_inference` stream may carry `SHADOW_KEY: True` in its metadata. The stream is then a client's mirror of another
server's session (`client.session.shadows`): the same span inputs at the same positions, sent so that this server
recomputes them and the client compares. A corolla server ranks such a session's steps behind the real steps queued up
to `SHADOW_LEAD_AFTER_S` after them (`runtime.Task.lead_after`), its single-token rows merged into the batched forwards
it runs anyway; a stock Petals server serves it as any session. Nothing else changes: the stream, its requests and
responses are those of any session."""

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
