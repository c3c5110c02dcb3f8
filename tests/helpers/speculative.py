"""A `VerifyTarget` over a local `transformers` model (no swarm) for speculative decoding tests: it keeps the token
list and recomputes the whole prefix each call, so a rollback is exact by construction."""

from __future__ import annotations

import torch


class LocalTarget:
    """`position` tokens are "in the cache"; `forward` appends `ids` there and returns the last logits."""

    def __init__(self, model: torch.nn.Module):
        self.model = model.eval()
        self.tokens: list[int] = []
        self.calls = 0

    @property
    def position(self) -> int:
        return len(self.tokens)

    @position.setter
    def position(self, value: int) -> None:
        if not 0 <= value <= len(self.tokens):
            raise ValueError(f"can only roll back to [0, {len(self.tokens)}], got {value}")
        del self.tokens[value:]

    @torch.no_grad()
    def forward(self, ids: torch.Tensor, num_logits: int) -> torch.Tensor:
        self.calls += 1
        self.tokens.extend(ids.tolist())
        logits = self.model(input_ids=torch.tensor([self.tokens])).logits  # [1, L, V]
        return logits[0, -num_logits:].to(torch.float32)  # [num_logits, V]
