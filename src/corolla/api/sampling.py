"""Choosing the next token from logits as vLLM and OpenAI define each sampling parameter.

`SamplingParams` holds what one request asks (validated: ValueError naming the limit); `Sampler` applies it step by
step over one sequence, in vLLM's order: `allowed_token_ids` and `logit_bias`, `min_tokens` (end tokens masked),
repetition penalty (HF/vLLM: over prompt and output, divide positive logits, multiply negative ones), presence and
frequency penalties (OpenAI: `logit -= count * frequency + (count > 0) * presence`, over generated tokens only), then
temperature, top-k, top-p and min-p; greedy (argmax of the penalized logits) at temperature 0. Log-probabilities are
the model's own (`log_softmax` of the raw logits, vLLM's default `raw_logprobs`). Sampling draws from a
`torch.Generator` of the request, seeded from its `seed`, so a seeded request is reproducible.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

MAX_PENALTY = 2.0  # |presence_penalty|, |frequency_penalty| (OpenAI's range)
MAX_REPETITION_PENALTY = 10.0  # repetition_penalty in (0, this]
MAX_LOGIT_BIAS = 100.0  # |bias| (OpenAI's range)


@dataclass(frozen=True)
class SamplingParams:
    """What one request asks of generation. `top_k` 0 or -1 and `min_p` 0 mean off; `logprobs` None = none returned,
    k = the chosen token's plus the k most likely (k >= 0)."""

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: frozenset[int] = frozenset()
    logit_bias: tuple[tuple[int, float], ...] = ()
    allowed_token_ids: tuple[int, ...] | None = None
    logprobs: int | None = None
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not 0.0 <= self.temperature <= 2.0:
            raise ValueError(f"temperature must be in [0, 2], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 or 0 (off) or >= 1, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not 0.0 < self.repetition_penalty <= MAX_REPETITION_PENALTY:
            raise ValueError(
                f"repetition_penalty must be in (0, {MAX_REPETITION_PENALTY}], got {self.repetition_penalty}"
            )
        for name in ("presence_penalty", "frequency_penalty"):
            if not -MAX_PENALTY <= getattr(self, name) <= MAX_PENALTY:
                raise ValueError(f"{name} must be in [-{MAX_PENALTY}, {MAX_PENALTY}], got {getattr(self, name)}")
        if not 0 <= self.min_tokens <= self.max_new_tokens:
            raise ValueError(f"min_tokens must be in [0, max_tokens={self.max_new_tokens}], got {self.min_tokens}")
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must be non-negative token ids")
        for token, bias in self.logit_bias:
            if token < 0 or not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise ValueError(f"logit_bias takes token ids >= 0 and biases in [-100, 100], got {token}: {bias}")
        if self.allowed_token_ids is not None and (
            not self.allowed_token_ids or any(t < 0 for t in self.allowed_token_ids)
        ):
            raise ValueError("allowed_token_ids must be a non-empty list of token ids")
        if self.logprobs is not None and self.logprobs < 0:
            raise ValueError(f"logprobs must be >= 0, got {self.logprobs}")

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


@dataclass(frozen=True)
class SampledToken:
    token_id: int
    logprob: float | None = None  # the model's log-probability of token_id (when logprobs were asked)
    top: tuple[tuple[int, float], ...] = ()  # the `logprobs` most likely (token id, log-probability), best first


@dataclass
class Sampler:
    """Samples the tokens of one sequence: remembers the prompt and what it generated (penalties, min_tokens)."""

    params: SamplingParams
    prompt_ids: Sequence[int]
    end_token_ids: Iterable[int] = ()  # EOS ids (of the tokenizer and generation_config)
    generator: torch.Generator | None = None
    generated: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.generator is None:
            self.generator = self.params.make_generator()
        masked = set(self.params.stop_token_ids)
        if not self.params.ignore_eos:
            masked |= set(self.end_token_ids)
        self._min_tokens_masked = sorted(masked)
        self._counts: torch.Tensor | None = None  # [V] occurrences of each token in the output
        self._seen: torch.Tensor | None = None  # [V] in the prompt or the output
        self._bias: torch.Tensor | None = None  # [V] logit_bias (summed per token), built once
        self._disallowed: torch.Tensor | None = None  # [V] bool, tokens outside allowed_token_ids

    def choose(self, logits: torch.Tensor) -> SampledToken:
        """Picks the next token from the last position's logits [V] and records it."""
        logits = logits.float()  # [V]
        token = pick(self.process(logits), self.params, self.generator)
        return self.record(token, logits)

    def record(self, token: int, logits: torch.Tensor) -> SampledToken:
        """Records `token` as the next one of the sequence (chosen from raw `logits` [V], by `choose` or by the
        speculative rule over `distribution_after`); returns it with its log-probabilities when asked."""
        logits = logits.float()  # [V]
        vocab = logits.shape[-1]
        counts, seen = self._state(vocab)
        result = SampledToken(token)
        if self.params.logprobs is not None:
            logprobs = torch.log_softmax(logits, dim=-1)  # [V]: the model's own distribution
            k = min(self.params.logprobs, vocab)
            top_values, top_ids = torch.topk(logprobs, k) if k else (torch.empty(0), torch.empty(0, dtype=torch.long))
            top = tuple(zip(top_ids.tolist(), top_values.tolist(), strict=True))
            result = SampledToken(token, float(logprobs[token]), top)
        self.generated.append(token)
        if 0 <= token < vocab:
            counts[token] += 1
            seen[token] = True
        return result

    def _state(self, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(occurrences of each token in the output [V], whether each is in the prompt or the output [V] bool),
        made at the first use."""
        if self._counts is None or self._seen is None:
            self._counts = torch.zeros(vocab)
            self._seen = torch.zeros(vocab, dtype=torch.bool)
            prompt = torch.tensor([t for t in self.prompt_ids if 0 <= t < vocab], dtype=torch.long)
            self._seen[prompt] = True
            self._prepare_masks(vocab)
        return self._counts, self._seen

    def process(self, logits: torch.Tensor) -> torch.Tensor:
        """The logits after every processor except temperature and truncation (a new tensor)."""
        return self._process(logits, *self._state(logits.shape[-1]), len(self.generated))

    def scores_after(self, extra: Sequence[int], logits: torch.Tensor) -> torch.Tensor:
        """`process` as it would be after the tokens `extra` had also been recorded (nothing is recorded): the
        penalties and `min_tokens` of a drafted continuation. `logits` [V] raw; returns [V]."""
        logits = logits.float()  # [V]
        vocab = logits.shape[-1]
        counts, seen = self._state(vocab)
        extra_ids = torch.tensor([t for t in extra if 0 <= t < vocab], dtype=torch.long)
        if extra_ids.numel():
            counts = counts.clone().index_add_(0, extra_ids, torch.ones(extra_ids.numel()))
            seen = seen.clone()
            seen[extra_ids] = True
        return self._process(logits, counts, seen, len(self.generated) + len(extra))

    def distribution_after(self, extra: Sequence[int], logits: torch.Tensor) -> torch.Tensor:
        """The distribution `choose` would draw from [V] (sums to 1) after `extra` (see `scores_after`): the
        truncated sampling distribution, or a point mass at the argmax when greedy."""
        scores = self.scores_after(extra, logits)  # [V]
        if self.params.greedy:
            return torch.nn.functional.one_hot(torch.argmax(scores), scores.shape[-1]).to(torch.float32)
        return truncated_probs(scores, self.params)

    def _process(
        self, logits: torch.Tensor, counts: torch.Tensor, seen: torch.Tensor, num_generated: int
    ) -> torch.Tensor:
        params, scores = self.params, logits.clone()
        vocab = scores.shape[-1]
        if self._bias is None or self._bias.shape[-1] != vocab:
            self._prepare_masks(vocab)
        if self._disallowed is not None:
            scores = scores.masked_fill(self._disallowed, float("-inf"))
        if params.logit_bias and self._bias is not None:
            scores = scores + self._bias
        if num_generated < params.min_tokens and self._min_tokens_masked:
            ids = torch.tensor([t for t in self._min_tokens_masked if t < vocab], dtype=torch.long)
            scores[ids] = float("-inf")
        if params.repetition_penalty != 1.0:
            penalized = torch.where(scores > 0, scores / params.repetition_penalty, scores * params.repetition_penalty)
            scores = torch.where(seen, penalized, scores)
        if params.presence_penalty or params.frequency_penalty:
            scores = scores - counts * params.frequency_penalty - (counts > 0) * params.presence_penalty
        return scores

    def _prepare_masks(self, vocab: int) -> None:
        """Tensors of `logit_bias` and `allowed_token_ids` (each token once per request, not once per step)."""
        self._bias = torch.zeros(vocab)
        ids = torch.tensor([t for t, _ in self.params.logit_bias if t < vocab], dtype=torch.long)
        biases = torch.tensor([b for t, b in self.params.logit_bias if t < vocab], dtype=torch.float32)
        self._bias.index_add_(0, ids, biases)
        if self.params.allowed_token_ids is not None:
            allowed = torch.tensor([t for t in self.params.allowed_token_ids if t < vocab], dtype=torch.long)
            self._disallowed = torch.ones(vocab, dtype=torch.bool)
            self._disallowed[allowed] = False


def pick(scores: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """Greedy, or temperature + top-k + top-p + min-p sampling over processed logits [V]."""
    if params.greedy:
        return int(torch.argmax(scores))
    return int(torch.multinomial(truncated_probs(scores, params), 1, generator=generator))


def truncated_probs(scores: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution sampling draws from [V] (sums to 1): softmax at the temperature, then top-k, top-p and min-p
    (each on the distribution left by the previous one, as transformers' warpers and vLLM apply them)."""
    probs = torch.softmax(scores / params.temperature, dim=-1)  # [V]
    if params.top_k > 0 and params.top_k < probs.shape[-1]:
        kth = torch.topk(probs, params.top_k).values[-1]
        probs = probs.masked_fill(probs < kth, 0.0)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs / probs.sum(), descending=True)  # [V], [V]
        cumulative = torch.cumsum(sorted_probs, dim=-1)
        # keep the smallest prefix whose mass reaches top_p (the token crossing the threshold stays)
        drop = (cumulative - sorted_probs) >= params.top_p
        probs = torch.zeros_like(probs).scatter(0, order, sorted_probs.masked_fill(drop, 0.0))
    if params.min_p > 0.0:
        probs = probs / probs.sum()
        probs = probs.masked_fill(probs < params.min_p * probs.max(), 0.0)
    return probs / probs.sum()
