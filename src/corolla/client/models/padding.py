"""Left-padded batches: rows grouped by padding length, so that each group runs as one batch with no pad
positions in its servers' caches (used by forward and by `generate()`)."""

from __future__ import annotations

import torch


def padding_groups(attention_mask: torch.Tensor) -> list[tuple[torch.Tensor, int]]:
    """Groups rows of a left-padded mask `[B, L]` by padding length: [(row indices, pad length)]."""
    mask = attention_mask.bool()
    pads = (~mask).int().cumprod(dim=1).sum(dim=1)  # leading zeros per row
    for row, pad in enumerate(pads.tolist()):
        if not bool(mask[row, pad:].all()):
            raise ValueError("attention_mask must use left padding (zeros only before the first token)")
    return [(torch.nonzero(pads == pad).flatten(), int(pad)) for pad in sorted(set(pads.tolist()))]
