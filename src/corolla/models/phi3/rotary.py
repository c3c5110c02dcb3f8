"""Partial rotary embeddings (Phi-4-mini's `partial_rotary_factor`): only the first `rotary_dim` channels of each
head are rotated (frequencies computed over `rotary_dim`), the rest pass through unchanged."""

from __future__ import annotations

from typing import Any

import torch

from corolla.models.positions import RotaryEmbedding


class PartialRotaryEmbedding(RotaryEmbedding):
    """`RotaryEmbedding` over the first `rotary_dim` of `head_dim` channels (`rotary_dim == head_dim`: the plain one)."""

    def __init__(self, head_dim: int, params: dict[str, Any], max_position_embeddings: int, *, rotary_dim: int):
        if rotary_dim < 2 or rotary_dim > head_dim or rotary_dim % 2:
            raise ValueError(f"rotary_dim must be even and in [2, head_dim={head_dim}], got {rotary_dim}")
        # The parent computes frequencies (and cos/sin tables) over its `head_dim`: give it the rotated width.
        super().__init__(rotary_dim, params, max_position_embeddings)
        self.full_head_dim = head_dim
        self.rotary_dim = rotary_dim

    def apply(self, q: torch.Tensor, k: torch.Tensor, position: int) -> tuple[torch.Tensor, torch.Tensor]:
        """q [B,h,T,hd], k [B,kv,T,hd] -> copies with channels [:rotary_dim] rotated, the rest unchanged."""
        if self.rotary_dim == self.full_head_dim:
            return super().apply(q, k, position)
        r = self.rotary_dim
        q_rot, k_rot = super().apply(q[..., :r], k[..., :r], position)  # [B,h,T,r], [B,kv,T,r]
        return torch.cat((q_rot, q[..., r:]), dim=-1), torch.cat((k_rot, k[..., r:]), dim=-1)
