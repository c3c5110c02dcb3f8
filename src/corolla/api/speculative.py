"""Speculative decoding behind the API (`corolla-api --speculative lookup|draft`): one choice runs through
`corolla.client.speculative.loop.SpeculativeLoop` with the request's own `Sampler` as the target distribution.

Exactness: at each drafted position the target distribution p is what the API's `Sampler` would draw from there
(`Sampler.distribution_after`: logit bias, allowed tokens, `min_tokens`, repetition/presence/frequency penalties over
the drafted continuation, then temperature, top-k, top-p, min-p). The loop's rejection rule keeps the emitted text
distributed exactly as plain API sampling; greedy requests (temperature 0) keep drafts while they equal the argmax of
the penalized logits, so the text is token-identical to the plain API's. Every emitted token is recorded by the
`Sampler` with the raw logits of its position (log-probabilities are the model's own, as in the plain path).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch
from transformers.generation.logits_process import LogitsProcessor, LogitsProcessorList

from corolla.api.sampling import SampledToken, Sampler
from corolla.client.speculative.acceptance import KChooser, SpeculativeConfig
from corolla.client.speculative.drafters import DraftModelDrafter, make_drafter
from corolla.client.speculative.loop import SpeculativeLoop, SpeculativeStats, VerifyTarget
from corolla.utils.logging import get_logger

logger = get_logger(__name__)


class SamplerProcessor(LogitsProcessor):
    """The request's `Sampler` as a logits processor over a prefix `[1, L]` = prompt + recorded tokens + drafted
    ones: returns the processed scores `[1, V]` whose softmax is the distribution the sampler draws from there
    (log-probabilities of the truncated distribution; the penalized logits themselves when greedy, for the argmax)."""

    def __init__(self, sampler: Sampler, prompt_length: int):
        self.sampler = sampler
        self.prompt_length = prompt_length

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        recorded = self.prompt_length + len(self.sampler.generated)
        if input_ids.shape[0] != 1 or input_ids.shape[1] < recorded:
            raise ValueError(f"expected one prefix of >= {recorded} tokens, got shape {tuple(input_ids.shape)}")
        extra = input_ids[0, recorded:].tolist()  # drafted tokens not yet recorded
        logits = scores[0]  # [V]
        if self.sampler.params.greedy:
            processed = self.sampler.scores_after(extra, logits)  # [V]
        else:
            processed = torch.log(self.sampler.distribution_after(extra, logits))  # [V], -inf where p = 0
        return processed[None].to(scores.dtype)  # type: ignore[return-value]


def run_speculative_choice(
    target: VerifyTarget,
    config: SpeculativeConfig,
    sampler: Sampler,
    prompt_ids: list[int],
    max_new_tokens: int,
    on_token: Callable[[SampledToken], bool],
    cancelled: threading.Event,
) -> SpeculativeStats:
    """Generates one choice through `target` (a fresh cache of the prompt's session): `on_token` gets each emitted
    token (recorded by `sampler`) and returns True when the choice ends there (EOS, stop token or string, length);
    a set `cancelled` ends it after the current token."""
    drafter = make_drafter(config)
    if isinstance(drafter, DraftModelDrafter):
        drafter.generator = sampler.generator  # a seeded request drafts reproducibly too
    loop = SpeculativeLoop(
        target=target,
        drafter=drafter,
        chooser=KChooser(max_k=config.max_draft_tokens, fixed_k=config.num_draft_tokens),
        processors=LogitsProcessorList([SamplerProcessor(sampler, len(prompt_ids))]),
        do_sample=not sampler.params.greedy,
        generator=sampler.generator,
    )

    def stop(ids: list[int], logits: torch.Tensor) -> bool:
        ended = on_token(sampler.record(ids[-1], logits))
        return ended or cancelled.is_set()

    loop.run(prompt_ids, max_new_tokens, stop)
    stats = loop.stats
    logger.debug(
        f"api.speculative.done(drafter={config.drafter}, tokens={stats.generated_tokens}, rounds={stats.rounds}, "
        f"acceptance={stats.acceptance_rate})"
    )
    return stats
