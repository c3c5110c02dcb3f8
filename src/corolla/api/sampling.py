"""Choosing the next token from logits: greedy at temperature 0, else temperature + nucleus (top-p) sampling,
reproducible per request through its own `torch.Generator` seeded from the request's `seed`."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    """What one request asks of generation (validated by the API layer)."""

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not 0.0 <= self.temperature <= 2.0:
            raise ValueError(f"temperature must be in [0, 2], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    def make_generator(self) -> torch.Generator:
        generator = torch.Generator()
        if self.seed is None:
            generator.seed()
        else:
            generator.manual_seed(self.seed)
        return generator


def sample_next_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """Picks one token id from `logits` [vocab] (any float dtype) under `params`."""
    logits = logits.float()  # [V]
    if params.greedy:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits / params.temperature, dim=-1)  # [V]
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)  # [V], [V]
        cumulative = torch.cumsum(sorted_probs, dim=-1)
        # keep the smallest prefix whose mass reaches top_p (the token crossing the threshold stays)
        drop = (cumulative - sorted_probs) >= params.top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        choice = torch.multinomial(sorted_probs / sorted_probs.sum(), 1, generator=generator)
        return int(order[choice])
    return int(torch.multinomial(probs, 1, generator=generator))
