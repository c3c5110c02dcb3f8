"""The OpenAI client the gateway tests talk through."""

from __future__ import annotations

import openai


def openai_client(server_url: str, *, timeout_s: float = 30.0) -> openai.OpenAI:
    """An `openai.OpenAI` client of the corolla gateway at `server_url` (its `/v1` API; any key: these gateways
    check none), without retries: a test sees the first answer."""
    return openai.OpenAI(base_url=server_url + "/v1", api_key="unused", max_retries=0, timeout=timeout_s)
