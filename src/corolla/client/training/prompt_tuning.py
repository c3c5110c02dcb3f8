"""Petals-compatible prompt tuning on the client (`tuning_mode="ptune" | "deep_ptune"`, `pre_seq_len`): trainable
prefix embeddings put before every sequence and, for deep prompt tuning, a trainable prompt per block that servers
add to the first `pre_seq_len` positions of that block's input (the `prompts` argument of the RPCs)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

TUNING_MODES = ("ptune", "deep_ptune")


@dataclass(frozen=True)
class TuningConfig:
    """`tuning_mode` None (no prompts), "ptune" or "deep_ptune"; `pre_seq_len` prefix tokens (Petals' names)."""

    tuning_mode: str | None = None
    pre_seq_len: int = 0

    def __post_init__(self) -> None:
        if self.tuning_mode is None:
            if self.pre_seq_len != 0:
                raise ValueError(f"pre_seq_len={self.pre_seq_len} needs tuning_mode='ptune' or 'deep_ptune'")
            return
        if self.tuning_mode not in TUNING_MODES:
            raise ValueError(f"tuning_mode must be None or one of {TUNING_MODES}, got {self.tuning_mode!r}")
        if not isinstance(self.pre_seq_len, int) or self.pre_seq_len < 1:
            raise ValueError(f"tuning_mode={self.tuning_mode!r} needs pre_seq_len >= 1, got {self.pre_seq_len!r}")

    @property
    def enabled(self) -> bool:
        return self.tuning_mode is not None

    @property
    def deep(self) -> bool:
        return self.tuning_mode == "deep_ptune"


class PromptTuning(nn.Module):
    """The trainable prompts, kept in float32 whatever the model's dtype (as Petals: optimizer state and small
    updates stay exact). `prompt_embeddings` start as N(0, 1) rows, the deep ones at zero (the untuned model's
    outputs), as in Petals; initialise them from token embeddings for a faster start."""

    def __init__(self, config: TuningConfig, *, hidden_size: int, num_blocks: int):
        super().__init__()
        if not config.enabled:
            raise ValueError("PromptTuning needs a tuning_mode")
        self.config, self.hidden_size, self.num_blocks = config, hidden_size, num_blocks
        self.pre_seq_len = config.pre_seq_len
        self.prompt_embeddings = nn.Embedding(self.pre_seq_len, hidden_size, dtype=torch.float32)
        self.intermediate_prompt_embeddings: nn.Embedding | None = None
        if config.deep:
            self.intermediate_prompt_embeddings = nn.Embedding(
                self.pre_seq_len, num_blocks * hidden_size, dtype=torch.float32
            )
            nn.init.zeros_(self.intermediate_prompt_embeddings.weight)

    def forward(self, batch_size: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(prefix embeddings [B, P, H], deep prompts [num_blocks, B, P, H] or None), in `dtype`, differentiable."""
        weight = self.prompt_embeddings.weight  # [P, H]
        prefix = weight.unsqueeze(0).expand(batch_size, -1, -1).to(dtype).contiguous()  # [B, P, H]
        if self.intermediate_prompt_embeddings is None:
            return prefix, None
        deep = self.intermediate_prompt_embeddings.weight.view(self.pre_seq_len, self.num_blocks, self.hidden_size)
        # one row per sequence, as Petals sends them (its servers return prompt gradients per row)
        deep = deep.permute(1, 0, 2).unsqueeze(1).expand(-1, batch_size, -1, -1)  # [num_blocks, B, P, H]
        return prefix, deep.to(dtype).contiguous()

    def extra_repr(self) -> str:
        return f"tuning_mode={self.config.tuning_mode}, pre_seq_len={self.pre_seq_len}, blocks={self.num_blocks}"
