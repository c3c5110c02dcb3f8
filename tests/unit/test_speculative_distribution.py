"""Speculative sampling on the demo model (run locally, no swarm) has exactly the plain sampling distribution:
the joint distribution of the first two sampled tokens (temperature 0.8, top-k 4: the processed p) passes a Pearson
chi-square test against the exact one, with prompt lookup and with the demo draft model; with the draft model and a
broken rule (always accept: the text then follows the draft's q) the same test fails, so it has power. Greedy
speculative text equals plain greedy with each drafter."""

from __future__ import annotations

import functools

import pytest
import torch
from tests.helpers.speculative import LocalTarget, broken_acceptance
from tests.unit.test_speculative_rule import chi_square_p_value
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from corolla.client.models.generation import GenerationLoop
from corolla.client.speculative.acceptance import KChooser, SpeculativeConfig
from corolla.client.speculative.drafters import make_drafter
from corolla.client.speculative.loop import SpeculativeLoop
from corolla.demo.checkpoint import DEMO_CHECKPOINT_DIR

pytestmark = pytest.mark.timeout(240)

PROMPT = "The value of the object is the value of the"
SAMPLES = 800
DRAFT_SAMPLES = 300  # the draft model runs per sample; at 300 the always-accept rule still fails by far (q != p)
SAMPLING = GenerationConfig(do_sample=True, temperature=0.8, top_k=4)


class MemoTarget(LocalTarget):
    """`LocalTarget` that remembers logits per token sequence (samples share most prefixes)."""

    @functools.cache  # noqa: B019 - one instance per test module
    def _logits(self, tokens: tuple[int, ...]) -> torch.Tensor:
        with torch.no_grad():
            return self.model(input_ids=torch.tensor([tokens])).logits[0].to(torch.float32)  # [L, V]

    def forward(self, ids: torch.Tensor, num_logits: int) -> torch.Tensor:
        self.tokens.extend(ids.tolist())
        return self._logits(tuple(self.tokens))[-num_logits:]


@pytest.fixture(scope="module")
def target() -> MemoTarget:
    return MemoTarget(AutoModelForCausalLM.from_pretrained(DEMO_CHECKPOINT_DIR, dtype=torch.float32))


@pytest.fixture(scope="module")
def prompt() -> list[int]:
    return AutoTokenizer.from_pretrained(DEMO_CHECKPOINT_DIR)(PROMPT)["input_ids"]


def _processors(prompt_length: int, config: GenerationConfig = SAMPLING):
    return GenerationLoop._processors(config, prompt_length, torch.tensor([257]), None)


def _exact_joint(target: MemoTarget, prompt: list[int]) -> torch.Tensor:
    """p(t1, t2) [V * V] under the processed distributions (what plain sampling draws)."""
    processors = _processors(len(prompt))

    def probs(prefix: list[int]) -> torch.Tensor:
        logits = target._logits(tuple(prefix))[-1:]  # [1, V]
        return torch.softmax(processors(torch.tensor([prefix]), logits.clone())[0], dim=-1)  # [V]

    first = probs(prompt)
    vocab = first.shape[0]
    joint = torch.zeros(vocab, vocab, dtype=torch.float64)
    for t1 in torch.nonzero(first).flatten().tolist():
        joint[t1] = first[t1].double() * probs(prompt + [t1]).double()
    return joint.flatten()


def _sampled_joint(target: MemoTarget, prompt: list[int], drafter: str, *, always_accept: bool = False) -> torch.Tensor:
    samples = DRAFT_SAMPLES if drafter == "draft" else SAMPLES
    torch.manual_seed(1234)
    config = SpeculativeConfig(drafter=drafter, num_draft_tokens=2)
    draft = make_drafter(config)
    vocab = target.model.config.vocab_size
    counts = torch.zeros(vocab * vocab)
    drafted = 0
    for _ in range(samples):
        target.position = 0
        loop = SpeculativeLoop(target, draft, KChooser(max_k=2, fixed_k=2), _processors(len(prompt)), True)
        # three tokens so that the first round drafts two (k <= tokens left - 1): both counted ones were drafted
        with broken_acceptance(always_accept):
            ids = loop.run(prompt, 3, lambda ids, logits: False)
        drafted += loop.stats.drafted_tokens
        counts[ids[len(prompt)] * vocab + ids[len(prompt) + 1]] += 1
    assert drafted >= samples  # every sample verified at least one drafted token
    return counts


@pytest.mark.parametrize("drafter", ["lookup", "draft"])
def test_sampled_text_has_the_plain_sampling_distribution(target, prompt, drafter) -> None:
    statistic, p_value = chi_square_p_value(_sampled_joint(target, prompt, drafter), _exact_joint(target, prompt))
    print(f"chi-square {drafter}: statistic={statistic:.1f}, p={p_value:.3g}")
    assert p_value > 0.001


def test_always_accepting_draft_model_tokens_fails_the_test(target, prompt) -> None:
    counts = _sampled_joint(target, prompt, "draft", always_accept=True)
    statistic, p_value = chi_square_p_value(counts, _exact_joint(target, prompt))
    print(f"chi-square draft, always accept: statistic={statistic:.1f}, p={p_value:.3g}")
    assert p_value < 1e-6


@pytest.mark.parametrize("drafter", ["lookup", "draft"])
def test_greedy_equals_plain_greedy(target, prompt, drafter) -> None:
    greedy = GenerationConfig(do_sample=False)
    with torch.no_grad():
        plain = target.model.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False)[0].tolist()
    target.position = 0
    loop = SpeculativeLoop(
        target,
        make_drafter(SpeculativeConfig(drafter=drafter)),
        KChooser(max_k=6),
        _processors(len(prompt), greedy),
        False,
    )
    assert loop.run(prompt, 24, lambda ids, logits: False) == plain
    assert loop.stats.rounds < 24
