"""Prompt tokens a choice took from the servers' prefix caches: the backend reports them (`report_cached_tokens`)
to the choice being generated (`counting_cached_tokens`), and the usage object shows them as OpenAI's
`prompt_tokens_details.cached_tokens`. Outside a choice, reports go nowhere."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass


@dataclass
class CachedTokens:
    """The cached prompt tokens of one choice (the positions its session's first step reused)."""

    count: int = 0


_current: ContextVar[CachedTokens | None] = ContextVar("corolla_api_cached_tokens", default=None)


@contextmanager
def counting_cached_tokens() -> Iterator[CachedTokens]:
    """Collects what the backend reports while the block runs (in this thread's context)."""
    counter = CachedTokens()
    token = _current.set(counter)
    try:
        yield counter
    finally:
        _current.reset(token)


def report_cached_tokens(count: int) -> None:
    counter = _current.get()
    if counter is not None:
        counter.count = count
