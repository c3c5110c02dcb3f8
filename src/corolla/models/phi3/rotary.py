"""Phi-3 rotary embeddings: partial rotary (Phi-4-mini's `partial_rotary_factor`: only the first `rotary_dim`
channels of each head are rotated, frequencies computed over `rotary_dim`) and LongRoPE scaling."""

from __future__ import annotations

import math
from typing import Any

import torch

from corolla.models.positions import RotaryEmbedding, rope_parameters


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


class LongRopeEmbedding(PartialRotaryEmbedding):
    """LongRoPE (Phi-3-128k, Phi-3.5, Phi-4-mini): per-frequency divisors `short_factor` while the sequence fits
    `original_max_position_embeddings`, `long_factor` beyond it, and cos/sin scaled by the attention factor
    (given, or sqrt(1 + ln(max_pos / original) / ln(original))). As in transformers, the choice follows the end
    of the current call (`position + length`): tokens written while the sequence was short keep their rotation."""

    def __init__(self, head_dim: int, params: dict[str, Any], max_position_embeddings: int, *, rotary_dim: int):
        super().__init__(head_dim, params, max_position_embeddings, rotary_dim=rotary_dim)
        half = rotary_dim // 2
        self.short_factor = [float(f) for f in params["short_factor"]]
        self.long_factor = [float(f) for f in params["long_factor"]]
        if len(self.short_factor) != half or len(self.long_factor) != half:
            raise ValueError(
                f"longrope short_factor/long_factor need {half} values (rotary_dim / 2), "
                f"got {len(self.short_factor)} and {len(self.long_factor)}"
            )
        self.original_max_position_embeddings = int(params["original_max_position_embeddings"])
        factor = params.get("factor") or max_position_embeddings / self.original_max_position_embeddings
        attention_factor = params.get("attention_factor")
        if attention_factor is None:
            attention_factor = 1.0
            if factor > 1.0:
                attention_factor = math.sqrt(1 + math.log(factor) / math.log(self.original_max_position_embeddings))
        self.longrope_scaling = float(attention_factor)

    def cos_sin(self, position: int, length: int, device: torch.device, dtype: torch.dtype):
        """cos, sin: [length, rotary_dim] for positions position..position+length-1, long factors past the original
        context (decided by position + length)."""
        end = position + length
        long = end > self.original_max_position_embeddings
        factors = torch.tensor(self.long_factor if long else self.short_factor, dtype=torch.float32, device=device)
        exponents = torch.arange(0, self.rotary_dim, 2, dtype=torch.int64, device=device).float() / self.rotary_dim
        inv_freq = 1.0 / (factors * float(self.params["rope_theta"]) ** exponents)  # [rotary_dim/2]
        positions = torch.arange(position, end, device=device, dtype=torch.float32)  # [T]
        freqs = positions[:, None] * inv_freq[None, :]  # [T, rotary_dim/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [T, rotary_dim]
        return (emb.cos() * self.longrope_scaling).to(dtype), (emb.sin() * self.longrope_scaling).to(dtype)


def phi3_rope_parameters(config) -> dict[str, Any]:
    """`positions.rope_parameters`, except that "longrope" (handled here) is accepted."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    if params.get("rope_type") == "longrope":
        params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
        params.setdefault("original_max_position_embeddings", getattr(config, "original_max_position_embeddings", None))
        return params
    return rope_parameters(config)


def make_phi3_rotary(config, head_dim: int) -> PartialRotaryEmbedding:
    params = phi3_rope_parameters(config)
    rotary_dim = int(head_dim * float(params.get("partial_rotary_factor", 1.0)))
    max_pos = int(config.max_position_embeddings)
    if params["rope_type"] == "longrope":
        return LongRopeEmbedding(head_dim, params, max_pos, rotary_dim=rotary_dim)
    return PartialRotaryEmbedding(head_dim, params, max_pos, rotary_dim=rotary_dim)
