"""Speculative decoding, the parts that do not touch the network: the config, the `Drafter` protocol, the
acceptance rule and the choice of k.

The acceptance rule is the standard rejection-sampling one (Leviathan et al. 2023, Chen et al. 2023): draft token
x_i (drawn from the drafter's q_i) is accepted with probability min(1, p_i(x_i) / q_i(x_i)); at the first rejection
the token is drawn from normalize(max(0, p_i - q_i)); when all k are accepted a bonus token is drawn from p_{k+1}.
The emitted text then has exactly the target's distribution p (the processed one: temperature, top-k, ...). A
drafter without a distribution (prompt lookup) proposes a point mass, q = one-hot. Greedy decoding is the limit of
this rule with p one-hot at argmax: a draft is kept while it equals the target's argmax, so the text is the same
as plain greedy.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

MAX_DRAFT_TOKENS = 32  # bound on k_max (one verification pass sends k + 1 tokens)


@dataclass(frozen=True)
class SpeculativeConfig:
    """Opt-in speculative decoding for `generate(speculative=...)`.

    `drafter`: "draft" (a small draft model: `draft_model_path`, default the demo model's draft) or "lookup" (prompt
    lookup: n-gram matches in the context). `num_draft_tokens`: a fixed k, or None to choose k each round from the
    measured acceptance rate and round-trip time (between 1 and `max_draft_tokens`)."""

    drafter: str = "lookup"
    num_draft_tokens: int | None = None
    max_draft_tokens: int = 8
    draft_model_path: str | None = None
    lookup_max_ngram: int = 3
    lookup_min_ngram: int = 1

    def __post_init__(self) -> None:
        if self.drafter not in ("draft", "lookup"):
            raise ValueError(f"speculative drafter must be 'draft' or 'lookup', got {self.drafter!r}")
        if not 1 <= self.max_draft_tokens <= MAX_DRAFT_TOKENS:
            raise ValueError(f"max_draft_tokens must be in [1, {MAX_DRAFT_TOKENS}], got {self.max_draft_tokens}")
        if self.num_draft_tokens is not None and not 1 <= self.num_draft_tokens <= MAX_DRAFT_TOKENS:
            raise ValueError(f"num_draft_tokens must be in [1, {MAX_DRAFT_TOKENS}], got {self.num_draft_tokens}")
        if not 1 <= self.lookup_min_ngram <= self.lookup_max_ngram <= 16:
            raise ValueError(
                f"need 1 <= lookup_min_ngram <= lookup_max_ngram <= 16, got {self.lookup_min_ngram}, "
                f"{self.lookup_max_ngram}"
            )


@dataclass
class Draft:
    """Proposed tokens `[k]` (int64) and, for a drafter that samples, the distributions they were drawn from
    `[k, V]` (fp32, rows sum to 1); `probs` None means point masses (q_i = one-hot at tokens[i])."""

    tokens: torch.Tensor
    probs: torch.Tensor | None = None

    def __len__(self) -> int:
        return int(self.tokens.numel())


# (prefix `[L]`, raw logits `[V]`) -> the processed distribution `[V]` (fp32) after the tokens `prefix`
Sampler = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class Drafter(Protocol):
    """Proposes up to k next tokens after `context` (int64 `[L]`, every token so far, prompt included).
    `sample` maps a drafter's raw logits `[V]` at a prefix to its sampling distribution (the same processors as the
    target's), so the draft's q is close to the target's p; greedy drafters ignore it (None: greedy)."""

    def propose(self, context: torch.Tensor, k: int, sample: Sampler | None) -> Draft: ...


@dataclass
class Verdict:
    """The outcome of one round: how many drafted tokens were accepted and the tokens emitted (the accepted ones and
    then the correction or bonus token: `num_accepted + 1` tokens)."""

    num_accepted: int
    tokens: list[int]


def accept_greedy(draft_tokens: torch.Tensor, target_scores: torch.Tensor) -> Verdict:
    """Greedy: `target_scores` `[k + 1, V]` (processed logits at each draft position and the bonus position). Keeps
    drafts while they equal the target's argmax; then emits the target's argmax."""
    best = torch.argmax(target_scores, dim=-1)  # [k + 1]
    k = draft_tokens.numel()
    matches = (best[:k] == draft_tokens).tolist()
    n = next((i for i, ok in enumerate(matches) if not ok), k)
    return Verdict(n, draft_tokens[:n].tolist() + [int(best[n])])


def accept_sampled(draft: Draft, target_probs: torch.Tensor, generator: torch.Generator | None = None) -> Verdict:
    """Rejection sampling: `target_probs` `[k + 1, V]` (the processed p at each draft position, then the bonus
    position)."""
    k = len(draft)
    tokens = draft.tokens.tolist()
    for i in range(k):
        p = target_probs[i]  # [V]
        x = tokens[i]
        q_x = float(draft.probs[i, x]) if draft.probs is not None else 1.0
        p_x = float(p[x])
        u = float(torch.rand((), generator=generator))
        if q_x > 0 and u * q_x < p_x:  # u < p/q without dividing by a tiny q
            continue
        if draft.probs is not None:
            residual = torch.clamp(p - draft.probs[i], min=0.0)  # [V]
        else:
            residual = p.clone()
            residual[x] = 0.0
        total = float(residual.sum())
        if total <= 0.0:  # p == q exactly: a rejection has probability 0 (only rounding gets here); p is exact
            residual = p
        token = int(torch.multinomial(residual, 1, generator=generator))
        return Verdict(i, tokens[:i] + [token])
    bonus = int(torch.multinomial(target_probs[k], 1, generator=generator))
    return Verdict(k, tokens + [bonus])


@dataclass
class KChooser:
    """Chooses k each round to maximise expected tokens per second under a simple model, from measurements:

    - acceptance rate a (EWMA over drafted tokens): a round with k drafts emits (1 - a^(k+1)) / (1 - a) tokens;
    - a round costs k * draft_s + verify(k + 1) seconds, verify(n) = rtt_s + n * per_token_s fitted online by
      least squares with forgetting over (n, measured seconds) of past rounds.

    With `fixed_k` set it always answers it (bounded by what is left)."""

    max_k: int
    fixed_k: int | None = None
    acceptance: float = 0.6  # prior
    smoothing: float = 0.15  # EWMA weight of a new observation
    draft_s: float = 0.0  # drafter seconds per token (EWMA)
    _n: float = 0.0  # least-squares sums with forgetting, over x = tokens sent, y = seconds
    _sx: float = 0.0
    _sy: float = 0.0
    _sxx: float = 0.0
    _sxy: float = 0.0

    def choose(self, limit: int) -> int:
        """k in [0, min(limit, max_k)]; 0 when nothing may be drafted."""
        upper = min(limit, self.max_k)
        if upper <= 0:
            return 0
        if self.fixed_k is not None:
            return min(self.fixed_k, upper)
        rtt_s, per_token_s = self.verify_model()
        if rtt_s <= 0.0:  # nothing measured yet: a middle guess
            return min(upper, max(1, self.max_k // 2))
        a = min(max(self.acceptance, 0.0), 0.99)
        best_k, best_rate = 1, -1.0
        for k in range(1, upper + 1):
            tokens = (1 - a ** (k + 1)) / (1 - a)
            seconds = k * self.draft_s + rtt_s + (k + 1) * per_token_s
            rate = tokens / seconds
            if rate > best_rate:
                best_k, best_rate = k, rate
        return best_k

    def verify_model(self) -> tuple[float, float]:
        """(fixed seconds per verification pass, seconds per token sent) from the fit; (0, 0) before any data."""
        if self._n <= 0:
            return 0.0, 0.0
        mean_x, mean_y = self._sx / self._n, self._sy / self._n
        var_x = self._sxx / self._n - mean_x**2
        slope = (self._sxy / self._n - mean_x * mean_y) / var_x if var_x > 1e-9 else 0.0
        slope = max(slope, 0.0)
        return max(mean_y - slope * mean_x, 1e-6), slope

    def record_round(self, num_drafted: int, num_accepted: int, sent_tokens: int, verify_s: float) -> None:
        keep = 1.0 - self.smoothing
        if num_drafted > 0:
            # an accepted prefix of n then a rejection: n successes and one failure (all k successes if none failed)
            trials = num_accepted + (1 if num_accepted < num_drafted else 0)
            rate = num_accepted / trials
            weight = 1.0 - keep**trials
            self.acceptance = (1 - weight) * self.acceptance + weight * rate
        if math.isfinite(verify_s) and verify_s >= 0:
            x = float(min(sent_tokens, 2 * (self.max_k + 1)))  # the prompt's first pass would dominate the fit
            self._n = keep * self._n + 1
            self._sx = keep * self._sx + x
            self._sy = keep * self._sy + verify_s
            self._sxx = keep * self._sxx + x * x
            self._sxy = keep * self._sxy + x * verify_s

    def record_draft(self, num_tokens: int, seconds: float) -> None:
        if num_tokens > 0:
            per_token = seconds / num_tokens
            self.draft_s = (
                per_token if self.draft_s == 0 else (1 - self.smoothing) * self.draft_s + self.smoothing * per_token
            )
