"""The fine-tuning demo's training loop: prompt-tunes a `DistributedModelForSequenceClassification` (its prompts and
`score` head; the swarm's blocks stay frozen) on the generated topic task (`demo.topics`) with Adam, evaluating
held-out accuracy as it goes. `corolla.cli.finetune_demo` runs it against a local or a real swarm."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from corolla.demo.topics import LABELS, Example, make_examples
from corolla.utils.logging import get_logger

logger = get_logger(__name__)


@dataclass(frozen=True)
class FinetuneConfig:
    """Schedule and sizes of the demo run (defaults: the figures in the README)."""

    tuning_mode: str = "ptune"
    pre_seq_len: int = 8
    num_steps: int = 60
    batch_size: int = 16
    prompt_lr: float = 0.02  # Adam's step size for the prompts
    head_lr: float = 0.01  # and for the score head
    num_train_examples: int = 512
    num_eval_examples: int = 96
    eval_every_steps: int = 20
    eval_batch_size: int = 48
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("num_steps", "batch_size", "num_train_examples", "num_eval_examples", "eval_batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.eval_every_steps < 1:
            raise ValueError(f"eval_every_steps must be >= 1, got {self.eval_every_steps}")


@dataclass
class FinetuneReport:
    """What a run measured: the training loss of every step, held-out accuracy at each evaluation."""

    config: dict[str, Any]
    chance_accuracy: float
    losses: list[float] = field(default_factory=list)
    evals: list[tuple[int, float]] = field(default_factory=list)  # (steps done, held-out accuracy)
    step_s: list[float] = field(default_factory=list)  # wall time of each training step (forward + backward + update)
    step_tokens: list[int] = field(default_factory=list)  # positions each step ran through the blocks (prompts too)
    train_s: float = 0.0  # wall time of the training steps and evaluations

    @property
    def final_accuracy(self) -> float:
        return self.evals[-1][1] if self.evals else math.nan

    @property
    def train_tokens_per_s(self) -> float:
        """Positions per second through the remote blocks, forward and backward, over the training steps alone."""
        return sum(self.step_tokens) / sum(self.step_s) if self.step_s else math.nan

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "final_accuracy": self.final_accuracy, "train_tokens_per_s": self.train_tokens_per_s}


def encode(tokenizer: Any, examples: list[Example]) -> dict[str, torch.Tensor]:
    """Right-padded input ids, mask and labels of `examples` (right padding: one remote call per batch, since
    padding after a causal sequence cannot change its last token)."""
    tokenizer.padding_side = "right"
    batch = tokenizer([e.text for e in examples], padding=True, return_tensors="pt")
    return {
        "input_ids": batch["input_ids"],  # [B, T]
        "attention_mask": batch["attention_mask"],  # [B, T]
        "labels": torch.tensor([e.label for e in examples]),  # [B]
    }


@torch.no_grad()
def accuracy(model: Any, tokenizer: Any, examples: list[Example], batch_size: int) -> float:
    correct = 0
    for first in range(0, len(examples), batch_size):
        batch = encode(tokenizer, examples[first : first + batch_size])
        logits = model(batch["input_ids"], attention_mask=batch["attention_mask"]).logits  # [B, labels]
        correct += int((logits.argmax(dim=-1) == batch["labels"]).sum())
    return correct / len(examples)


def init_prompts_from_text(model: Any, tokenizer: Any, text: str) -> None:
    """Starts the prefix from the embeddings of `text`'s tokens (repeated to `pre_seq_len`): a better start than
    N(0, 1) rows, as in PEFT's text initialization."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    weight = model.prompt_tuning.prompt_embeddings.weight  # [P, H]
    rows = torch.tensor([ids[i % len(ids)] for i in range(weight.shape[0])])
    with torch.no_grad():
        weight.copy_(model.embeddings.weight[rows].float())


def finetune(
    model: Any, tokenizer: Any, config: FinetuneConfig, *, on_progress: Callable[[str], None] = lambda line: None
) -> FinetuneReport:
    """Trains `model` (a prompt-tuned DistributedModelForSequenceClassification with len(LABELS) labels)."""
    train_set = make_examples(config.num_train_examples, seed=config.seed)
    eval_set = make_examples(config.num_eval_examples, seed=config.seed + 1, held_out=True)
    report = FinetuneReport(config=asdict(config), chance_accuracy=1.0 / len(LABELS))
    generator = torch.Generator().manual_seed(config.seed)
    with torch.no_grad():  # the head's start from the seed, not from whatever drew from torch's RNG before
        std = float(getattr(model.config, "initializer_range", 0.02))
        torch.nn.init.normal_(model.score.weight, std=std, generator=generator)
    optimizer = torch.optim.Adam(
        [
            {"params": list(model.prompt_tuning.parameters()), "lr": config.prompt_lr},
            {"params": list(model.score.parameters()), "lr": config.head_lr},
        ]
    )
    started = time.perf_counter()
    report.evals.append((0, accuracy(model, tokenizer, eval_set, config.eval_batch_size)))
    on_progress(f"step   0: held-out accuracy {report.evals[-1][1]:.1%} (chance {report.chance_accuracy:.0%})")
    model.train()
    for step in range(1, config.num_steps + 1):
        rows = torch.randint(0, len(train_set), (config.batch_size,), generator=generator).tolist()
        batch = encode(tokenizer, [train_set[i] for i in rows])
        step_started = time.perf_counter()
        optimizer.zero_grad()
        loss = model(**batch).loss
        loss.backward()  # through the swarm: servers return gradients wrt their inputs and deep prompts
        optimizer.step()
        report.losses.append(loss.item())
        report.step_s.append(time.perf_counter() - step_started)
        report.step_tokens.append(batch["input_ids"].numel() + config.batch_size * config.pre_seq_len)
        if step % config.eval_every_steps == 0 or step == config.num_steps:
            model.eval()
            report.evals.append((step, accuracy(model, tokenizer, eval_set, config.eval_batch_size)))
            model.train()
            recent = report.losses[-config.eval_every_steps :]
            on_progress(
                f"step {step:3d}: train loss {sum(recent) / len(recent):.3f}, held-out accuracy "
                f"{report.evals[-1][1]:.1%} ({time.perf_counter() - started:.0f} s)"
            )
    model.eval()
    report.train_s = time.perf_counter() - started
    logger.info(
        "finetune.done(steps=%d, final_accuracy=%.3f, train_s=%.1f)",
        config.num_steps, report.final_accuracy, report.train_s,
    )  # fmt: skip
    return report
