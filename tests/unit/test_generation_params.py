"""The API's sampling (`corolla.api.sampling`) keeps the same tokens as transformers' own processors and warpers:
top-k, top-p, min-p at a temperature, and the repetition penalty over prompt and output (pure tensor math)."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from corolla.api.sampling import Sampler, SamplingParams, truncated_probs

VOCAB = 200


def hf_support(logits: torch.Tensor, *, temperature: float, top_k: int, top_p: float, min_p: float) -> set[int]:
    scores = logits[None].clone()
    ids = torch.zeros(1, 1, dtype=torch.long)
    scores = TemperatureLogitsWarper(temperature)(ids, scores)
    if top_k > 0:
        scores = TopKLogitsWarper(top_k)(ids, scores)
    if top_p < 1.0:
        scores = TopPLogitsWarper(top_p)(ids, scores)
    if min_p > 0.0:
        scores = MinPLogitsWarper(min_p)(ids, scores)
    return set(torch.nonzero(torch.isfinite(scores[0])).flatten().tolist())


@pytest.mark.parametrize(
    "temperature, top_k, top_p, min_p",
    [(1.0, 10, 1.0, 0.0), (0.7, 0, 0.8, 0.0), (1.3, 0, 1.0, 0.05), (0.9, 50, 0.9, 0.02), (2.0, 5, 0.5, 0.1)],
)
def test_truncation_keeps_the_tokens_transformers_keeps(temperature, top_k, top_p, min_p):
    for seed in range(5):
        logits = torch.randn(VOCAB, generator=torch.Generator().manual_seed(seed)) * 3
        params = SamplingParams(max_new_tokens=1, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
        probs = truncated_probs(logits, params)
        ours = set(torch.nonzero(probs > 0).flatten().tolist())
        assert ours == hf_support(logits, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
        assert float(probs.sum()) == pytest.approx(1.0, abs=1e-5)
        kept = torch.tensor(sorted(ours))
        expected = torch.softmax(logits[kept] / temperature, dim=-1)  # relative odds of the kept tokens unchanged
        assert torch.allclose(probs[kept], expected, atol=1e-6)


def test_repetition_penalty_equals_transformers_over_prompt_and_output():
    logits = torch.randn(VOCAB, generator=torch.Generator().manual_seed(3)) * 2
    prompt, output = [5, 9, 120], [9, 44]
    sampler = Sampler(SamplingParams(max_new_tokens=8, repetition_penalty=1.3, temperature=0), prompt)
    for token in output:
        forced = torch.full((VOCAB,), -1e4)
        forced[token] = 1e4
        assert sampler.choose(forced).token_id == token
    expected = RepetitionPenaltyLogitsProcessor(1.3)(torch.tensor([prompt + output]), logits[None].clone())[0]
    assert torch.allclose(sampler.process(logits), expected)


def test_min_tokens_masks_end_and_stop_tokens_then_releases_them():
    params = SamplingParams(max_new_tokens=5, min_tokens=2, stop_token_ids=frozenset({7}), temperature=0)
    sampler = Sampler(params, [1], end_token_ids=[2])
    logits = torch.zeros(10)
    logits[2], logits[7], logits[3] = 5.0, 4.0, 1.0
    assert [sampler.choose(logits).token_id for _ in range(3)] == [3, 3, 2]
    ignoring = Sampler(SamplingParams(max_new_tokens=5, min_tokens=2, ignore_eos=True, temperature=0), [1], [2])
    assert ignoring.choose(logits).token_id == 2  # ignore_eos: EOS does not end it, so it is not masked either
