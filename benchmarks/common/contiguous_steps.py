"""The baseline the engine's one KV pool replaced (`docs/decisions/0014`): a session's step through contiguous
per-block caches, each block run by the server's `SpanBackend.cached_forward` (the path long forwards still take)."""

from __future__ import annotations

import torch

from corolla.server.backend import SpanBackend


def contiguous_step(
    backend: SpanBackend, hidden: torch.Tensor, caches: list[list[torch.Tensor]], position: int, adapter: str = ""
) -> torch.Tensor:
    """`hidden` [B, T, H] at positions [position, position + T) through every block of `backend` in order, each
    writing its keys and values into its cache of `caches` (`cache_descriptors`' layout, one list per block) and
    attending to the earlier ones there, with `adapter` ("" for none): [B, T, H]."""
    with backend.adapter_context(adapter):
        for index, cache in zip(sorted(backend.blocks), caches, strict=True):
            hidden = backend.cached_forward(index, hidden, cache, position)
    return hidden
