"""Speculative decoding without a model: the rejection rule on toy distributions (the emitted token follows p for
a sampling drafter and for a point-mass drafter; always accepting follows q instead), greedy acceptance, prompt
lookup proposals and the choice of k."""

from __future__ import annotations

import pytest
import torch
from tests.helpers.speculative import accept_all

from corolla.client.speculative.acceptance import Draft, KChooser, SpeculativeConfig, accept_greedy, accept_sampled
from corolla.client.speculative.drafters import PromptLookupDrafter


def chi_square_p_value(counts: torch.Tensor, expected_probs: torch.Tensor) -> tuple[float, float]:
    """Pearson goodness of fit: (statistic, p-value); categories expected < 5 times are pooled."""
    n = float(counts.sum())
    expected = expected_probs.double() * n
    small = expected < 5
    obs = torch.cat([counts[~small].double(), counts[small].double().sum()[None]])
    exp = torch.cat([expected[~small], expected[small].sum()[None]])
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    statistic = float(((obs - exp) ** 2 / exp).sum())
    dof = int(keep.sum()) - 1
    p_value = float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), torch.tensor(statistic / 2)))
    return statistic, p_value


P = torch.tensor([[0.5, 0.2, 0.2, 0.1, 0.0], [0.1, 0.1, 0.3, 0.3, 0.2]])  # target at position 0 and the bonus
Q = torch.tensor([[0.1, 0.6, 0.1, 0.1, 0.1]])  # the drafter's distribution at position 0


def _first_tokens(draw_draft, p: torch.Tensor, trials: int, *, rule=accept_sampled) -> torch.Tensor:
    generator = torch.Generator().manual_seed(7)
    counts = torch.zeros(p.shape[1])
    for _ in range(trials):
        verdict = rule(draw_draft(generator), p, generator)
        counts[verdict.tokens[0]] += 1
    return counts


def _sampled_draft(generator: torch.Generator) -> Draft:
    return Draft(torch.multinomial(Q[0], 1, generator=generator), Q)


@pytest.mark.parametrize(
    "draw",
    [_sampled_draft, lambda g: Draft(torch.tensor([1])), lambda g: Draft(torch.tensor([4]))],
    ids=["sampled-q", "point-mass-likely", "point-mass-impossible"],
)
def test_first_token_follows_target_distribution(draw) -> None:
    counts = _first_tokens(draw, P, 1500)
    _, p_value = chi_square_p_value(counts, P[0])
    assert p_value > 0.001, counts
    assert counts[4] == 0  # p(4) = 0: never emitted, even when drafted


def test_always_accepting_follows_the_draft_instead() -> None:
    counts = _first_tokens(_sampled_draft, P, 1500, rule=accept_all)
    _, p_value = chi_square_p_value(counts, P[0])
    assert p_value < 1e-6


def test_bonus_token_follows_the_last_target_distribution() -> None:
    same = torch.stack([Q[0], P[1]])  # p == q at position 0: every draft is accepted, then the bonus from p[1]
    generator = torch.Generator().manual_seed(3)
    counts = torch.zeros(5)
    for _ in range(1500):
        verdict = accept_sampled(Draft(torch.multinomial(Q[0], 1, generator=generator), Q), same, generator)
        assert verdict.num_accepted == 1 and len(verdict.tokens) == 2
        counts[verdict.tokens[1]] += 1
    assert chi_square_p_value(counts, P[1])[1] > 0.001


def test_greedy_keeps_drafts_while_they_match_argmax() -> None:
    scores = torch.tensor([[0.0, 5.0, 1.0], [3.0, 0.0, 1.0], [0.0, 0.0, 9.0]])  # argmax 1, 0, 2
    assert accept_greedy(torch.tensor([1, 0]), scores).tokens == [1, 0, 2]  # all accepted + bonus
    verdict = accept_greedy(torch.tensor([1, 2]), scores)
    assert (verdict.num_accepted, verdict.tokens) == (1, [1, 0])
    assert accept_greedy(torch.tensor([], dtype=torch.int64), scores[:1]).tokens == [1]


def test_prompt_lookup_proposes_what_followed_the_latest_match() -> None:
    drafter = PromptLookupDrafter(max_ngram=3)
    context = torch.tensor([5, 6, 7, 8, 9, 1, 5, 6, 7, 2, 3, 5, 6, 7])
    # the trigram 5 6 7 occurred at 0 (then 8 9) and at 6 (then 2 3): the latest wins
    assert drafter.propose(context, 2, None).tokens.tolist() == [2, 3]
    assert drafter.propose(context, 10, None).tokens.tolist() == [2, 3, 5, 6, 7]
    assert len(drafter.propose(torch.tensor([1, 2, 3, 4]), 4, None)) == 0  # no repeated n-gram
    assert drafter.propose(torch.tensor([4, 9, 4]), 3, None).tokens.tolist() == [9, 4]  # unigram fallback
    assert drafter.propose(context, 2, None).probs is None  # a point mass


def test_k_follows_acceptance_and_round_trip() -> None:
    def chooser_after(acceptance: float, rtt_s: float, per_token_s: float) -> int:
        chooser = KChooser(max_k=8, acceptance=acceptance, smoothing=0.5)
        for n in (2, 5, 3, 9, 4):
            chooser.record_round(0, 0, n, rtt_s + n * per_token_s)
        chooser.record_draft(4, 4 * 0.0005)
        return chooser.choose(100)

    slow_network = chooser_after(0.8, 0.1, 0.001)
    assert slow_network >= 6  # a long round trip and good drafts: draft far ahead
    assert chooser_after(0.2, 0.1, 0.001) < slow_network
    assert chooser_after(0.8, 0.001, 0.01) < slow_network  # compute-bound: extra tokens cost nearly a round
    chooser = KChooser(max_k=8, fixed_k=5)
    assert chooser.choose(100) == 5 and chooser.choose(3) == 3 and chooser.choose(0) == 0


def test_acceptance_rate_is_measured() -> None:
    chooser = KChooser(max_k=8)
    chooser.record_round(4, 4, 5, 0.01)
    after_accepts = chooser.acceptance
    chooser.record_round(4, 0, 5, 0.01)
    assert 0.6 < chooser.acceptance < after_accepts < 1.0  # the 0.6 prior rose by four accepts, fell by one rejection


def test_config_is_validated() -> None:
    with pytest.raises(ValueError, match="drafter"):
        SpeculativeConfig(drafter="oracle")
    with pytest.raises(ValueError, match=r"\[1, 32\]"):
        SpeculativeConfig(max_draft_tokens=100)
