"""The reference the fast-path engine tests compare with: the blocks' own cached forward, step by step."""

from __future__ import annotations

from collections.abc import Sequence

import torch


@torch.no_grad()
def cached_block_steps(
    blocks: Sequence[torch.nn.Module], max_length_tokens: int, steps: list[tuple[torch.Tensor, int]]
) -> list[torch.Tensor]:
    """Runs (hidden [B, T, H], position) steps through `blocks` with one fresh cache per block of
    `max_length_tokens` (each block's own `cache_descriptors`: K/V, latents or a sliding ring); returns the outputs."""
    batch = steps[0][0].shape[0]
    caches = [[d.make_zeros() for d in block.cache_descriptors(batch, max_length_tokens)] for block in blocks]
    outs = []
    for x, position in steps:
        h = x
        for block, cache in zip(blocks, caches, strict=True):
            h = block(h, cache=cache, position=position)
        outs.append(h)
    return outs
