"""corolla-api with speculative decoding (`ApiConfig.speculative`) over the demo model run in-process: greedy
requests with penalties, logit bias and logprobs give the same tokens, text and log-probabilities as the plain API
with each drafter, in fewer target passes; sampled text (presence penalty, temperature, top-k) has the API sampler's
exact two-token joint distribution (Pearson chi-square), and the always-accept rule fails that test."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import pytest
import torch
from fastapi.testclient import TestClient
from tests.helpers.speculative import LocalTarget, broken_acceptance
from tests.unit.test_speculative_distribution import MemoTarget
from tests.unit.test_speculative_rule import chi_square_p_value
from transformers import AutoModelForCausalLM, AutoTokenizer

from corolla.api.app import ApiConfig, create_app
from corolla.api.backend import TokenizerCodec
from corolla.api.sampling import SampledToken, Sampler, SamplingParams
from corolla.api.speculative import run_speculative_choice
from corolla.client.speculative.acceptance import SpeculativeConfig
from corolla.demo.checkpoint import DEMO_CHECKPOINT_DIR

pytestmark = pytest.mark.timeout(240)

PROMPT = "The value of the object is the value of the"


class DemoBackend(TokenizerCodec):
    """The demo model in-process: `step_logits` recomputes the prefix each step; `verify_target` is a `LocalTarget`.
    Counts target passes of each kind."""

    def __init__(self) -> None:
        tokenizer = AutoTokenizer.from_pretrained(DEMO_CHECKPOINT_DIR)
        super().__init__(tokenizer, max_context_tokens=512)
        self.model = AutoModelForCausalLM.from_pretrained(DEMO_CHECKPOINT_DIR, dtype=torch.float32).eval()
        self.model_id = "demo"
        self.vocab_size = int(self.model.config.vocab_size)
        self.plain_steps = 0
        self.verify_passes = 0

    def step_logits(self, prompt_ids: list[int], max_length: int) -> Iterator[torch.Tensor]:
        ids = list(prompt_ids)
        while True:
            self.plain_steps += 1
            with torch.no_grad():
                logits = self.model(input_ids=torch.tensor([ids])).logits[0, -1].float()  # [V]
            ids.append((yield logits))

    @contextlib.contextmanager
    def verify_target(self, max_length: int) -> Iterator[LocalTarget]:
        backend = self

        class Counted(LocalTarget):
            def forward(self, ids: torch.Tensor, num_logits: int) -> torch.Tensor:
                backend.verify_passes += 1
                return super().forward(ids, num_logits)

        yield Counted(self.model)


@pytest.fixture(scope="module")
def backend() -> DemoBackend:
    return DemoBackend()


def _complete(backend: DemoBackend, speculative: SpeculativeConfig | None, body: dict) -> dict:
    with TestClient(create_app(backend, ApiConfig(speculative=speculative))) as client:
        response = client.post("/v1/completions", json={"model": "demo", "prompt": PROMPT, **body})
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]


GREEDY = {
    "max_tokens": 20,
    "temperature": 0,
    "repetition_penalty": 1.2,
    "frequency_penalty": 0.3,
    "logit_bias": {"101": 1.5},
    "logprobs": 2,
}


@pytest.mark.parametrize("drafter", ["lookup", "draft"])
def test_greedy_speculative_equals_plain_api(backend: DemoBackend, drafter: str) -> None:
    backend.plain_steps = 0
    plain = _complete(backend, None, GREEDY)
    plain_steps = backend.plain_steps
    backend.verify_passes = 0
    fast = _complete(backend, SpeculativeConfig(drafter=drafter, num_draft_tokens=4), GREEDY)
    assert fast["text"] == plain["text"] and fast["finish_reason"] == plain["finish_reason"]
    assert fast["logprobs"]["tokens"] == plain["logprobs"]["tokens"]
    assert fast["logprobs"]["token_logprobs"] == pytest.approx(plain["logprobs"]["token_logprobs"], abs=1e-4)
    print(f"{drafter}: plain steps {plain_steps}, speculative passes {backend.verify_passes}")
    assert backend.verify_passes < plain_steps


SAMPLED = SamplingParams(max_new_tokens=3, temperature=1.0, top_k=6, presence_penalty=1.5)
SAMPLES = 400


def _exact_joint(backend: DemoBackend, prompt: list[int]) -> torch.Tensor:
    """p(t1, t2) [V * V] as the plain API sampler draws them (the penalty on t2 depends on t1)."""

    def logits(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return backend.model(input_ids=torch.tensor([ids])).logits[0, -1].float()  # [V]

    first = Sampler(SAMPLED, prompt).distribution_after([], logits(prompt))  # [V]
    vocab = first.shape[0]
    joint = torch.zeros(vocab, vocab, dtype=torch.float64)
    for t1 in torch.nonzero(first).flatten().tolist():
        second = Sampler(SAMPLED, prompt).distribution_after([t1], logits(prompt + [t1]))  # [V]
        joint[t1] = first[t1].double() * second.double()
    return joint.flatten()


def _sampled_joint(target: MemoTarget, prompt: list[int], *, always_accept: bool) -> torch.Tensor:
    """Counts of the first two tokens of SAMPLES speculative choices of three tokens (the first round drafts two)."""
    vocab = target.model.config.vocab_size
    counts = torch.zeros(vocab * vocab)
    generator = torch.Generator().manual_seed(99)
    config = SpeculativeConfig(drafter="lookup", num_draft_tokens=2)  # point-mass drafts: no draft model per sample
    for _ in range(SAMPLES):
        sampler = Sampler(SAMPLED, prompt, generator=generator)
        tokens: list[int] = []

        def on_token(sampled: SampledToken, tokens: list[int] = tokens) -> bool:
            tokens.append(sampled.token_id)
            return len(tokens) >= SAMPLED.max_new_tokens

        target.position = 0
        with broken_acceptance(always_accept):
            run_speculative_choice(target, config, sampler, prompt, 3, on_token, threading.Event())
        counts[tokens[0] * vocab + tokens[1]] += 1
    return counts


def test_sampled_text_has_the_api_sampler_distribution(backend: DemoBackend) -> None:
    prompt = backend.encode(PROMPT)
    exact = _exact_joint(backend, prompt)
    target = MemoTarget(backend.model)  # remembers logits per prefix (the samples share them)
    statistic, p_value = chi_square_p_value(_sampled_joint(target, prompt, always_accept=False), exact)
    print(f"api chi-square, correct rule: statistic={statistic:.1f}, p={p_value:.3g}")
    assert p_value > 0.001
    statistic, p_value = chi_square_p_value(_sampled_joint(target, prompt, always_accept=True), exact)
    print(f"api chi-square, always accept: statistic={statistic:.1f}, p={p_value:.3g}")
    assert p_value < 0.001
