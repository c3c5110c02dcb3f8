"""For speculative decoding tests: a `VerifyTarget` over a local `transformers` model (no swarm), which keeps the
token list and recomputes the whole prefix each call, so a rollback is exact by construction; and a wrong acceptance
rule (`accept_all`, `broken_acceptance`) that shows the distribution tests can fail."""

from __future__ import annotations

import contextlib
from unittest import mock

import torch

from corolla.client.speculative.acceptance import Draft, Verdict


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


def accept_all(draft: Draft, target_probs: torch.Tensor, generator: torch.Generator | None = None) -> Verdict:
    """A wrong rule: every drafted token accepted, then the bonus token drawn from the last p."""
    bonus = int(torch.multinomial(target_probs[len(draft)], 1, generator=generator))
    return Verdict(len(draft), draft.tokens.tolist() + [bonus])


def broken_acceptance(broken: bool = True) -> contextlib.AbstractContextManager:
    """A block in which (if `broken`) `SpeculativeLoop` accepts every drafted token (`accept_all`)."""
    if not broken:
        return contextlib.nullcontext()
    return mock.patch("corolla.client.speculative.loop.accept_sampled", accept_all)
