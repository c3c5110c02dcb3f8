"""Reusing a prefix the servers of a chain already hold: which servers take prefix keys, and the probe (each server's
zero-token first step with the keys of the known positions, answered with how many it holds)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Protocol

import torch

from corolla.protocol.records import ServerInfo


class Probed(Protocol):
    """What the probe needs of a `span_session.SpanSession` (which imports this module's users: named by shape)."""

    async def probe(self, keys_until: int, like: torch.Tensor) -> int: ...


def speaks_prefix_keys(info: ServerInfo) -> bool:
    """corolla servers announce their load (`tokens_served` always) and take `corolla.prefix` keys; a stock Petals
    server's record has no load fields, and it gets the usual first step (it would not answer a probe's hit)."""
    return info.tokens_served is not None


async def probe_chain(spans: Sequence[Probed], *, keys_until: int, like: torch.Tensor) -> list[int]:
    """Probes every span concurrently (one round trip for the chain); returns each server's hit in block order."""
    return list(await asyncio.gather(*(span.probe(keys_until, like) for span in spans)))
