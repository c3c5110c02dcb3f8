"""Distributed sequence classification (Petals' `Distributed<X>ForSequenceClassification`, `transformers`'
`<X>ForSequenceClassification`): a trainable linear `score` head on the final-normed hidden state of each sequence's
last non-padding token, with `transformers`' losses (regression, single- or multi-label)."""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn
from transformers.modeling_outputs import SequenceClassifierOutput

from corolla.client.models.distributed_model import ClientLayout, DistributedModel, load_distributed_model
from corolla.client.routing.sequence_manager import RemoteSequenceManager
from corolla.client.training.prompt_tuning import TuningConfig

SCORE = "score"  # the head's name in transformers' checkpoints of every family


class DistributedModelForSequenceClassification(DistributedModel):
    """`forward(input_ids, attention_mask=None, labels=None)` -> `SequenceClassifierOutput(loss, logits [B, labels])`.
    The `score` head (bias-free, as in `transformers`) is read from the checkpoint when it has one, else initialised
    N(0, initializer_range); it trains, as do the prompts of a `tuning_mode`."""

    main_input_name = "input_ids"

    def __init__(
        self,
        config: Any,
        layout: ClientLayout,
        manager: RemoteSequenceManager,
        tuning: TuningConfig | None = None,
        *,
        num_labels: int | None = None,
        problem_type: str | None = None,
    ):
        super().__init__(config, layout, manager, tuning)
        if num_labels is not None:
            config.num_labels = num_labels  # also sets id2label/label2id, as transformers' kwargs do
        if problem_type is not None:
            config.problem_type = problem_type
        self.num_labels = config.num_labels
        self.score = nn.Linear(config.hidden_size, self.num_labels, bias=False)
        nn.init.normal_(self.score.weight, std=float(getattr(config, "initializer_range", 0.02)))

    def head_tensor_names(self) -> list[str]:
        return [f"{SCORE}.weight"]

    def load_head(self, tensors: dict[str, torch.Tensor]) -> None:
        weight = tensors.get(f"{SCORE}.weight")
        if weight is not None and tuple(weight.shape) == tuple(self.score.weight.shape):
            self.score.weight.copy_(weight)

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, labels: torch.Tensor | None = None
    ) -> SequenceClassifierOutput:
        if input_ids.ndim != 2:
            raise ValueError(f"input_ids must be [batch, tokens], got shape {list(input_ids.shape)}")
        batch_size = input_ids.shape[0]
        if attention_mask is not None and _right_padded(attention_mask):
            attention_mask = None  # causal blocks: padding after a sequence's last token cannot change it
        hidden = self.hidden_states(input_ids, attention_mask)  # [B, T, H]
        logits = self.score(hidden)  # [B, T, labels]
        pad_id = getattr(self.config, "pad_token_id", None)
        if pad_id is None:
            if batch_size != 1:
                raise ValueError("batches of more than one sequence need config.pad_token_id (as in transformers)")
            last = torch.full((1,), input_ids.shape[1] - 1, dtype=torch.long)
        else:  # transformers' rule: the rightmost token that is not padding
            non_pad = (input_ids != pad_id).to(torch.long)  # [B, T]
            last = (torch.arange(input_ids.shape[1]) * non_pad.cpu()).argmax(dim=-1)  # [B]
        pooled = logits[torch.arange(batch_size, device=logits.device), last.to(logits.device)]  # [B, labels]
        loss = self.loss(pooled, labels) if labels is not None else None
        return SequenceClassifierOutput(loss=loss, logits=pooled)

    def loss(self, pooled: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """`transformers`' sequence-classification loss, `config.problem_type` inferred as it does."""
        labels = labels.to(pooled.device)
        problem_type = self.config.problem_type
        if problem_type is None:
            if self.num_labels == 1:
                problem_type = "regression"
            elif labels.dtype in (torch.long, torch.int):
                problem_type = "single_label_classification"
            else:
                problem_type = "multi_label_classification"
            self.config.problem_type = problem_type
        if problem_type == "regression":
            if self.num_labels == 1:
                return nn.functional.mse_loss(pooled.squeeze().float(), labels.squeeze().float())
            return nn.functional.mse_loss(pooled.float(), labels.float())
        if problem_type == "single_label_classification":
            return nn.functional.cross_entropy(pooled.float().view(-1, self.num_labels), labels.view(-1))
        return nn.functional.binary_cross_entropy_with_logits(pooled.float(), labels.float())


def _right_padded(attention_mask: torch.Tensor) -> bool:
    """True when every row of a mask [B, T] is ones then zeros (padding only at the end)."""
    mask = attention_mask.bool()
    return bool((mask[:, :-1] | ~mask[:, 1:]).all())  # no 0 followed by a 1


class AutoDistributedModelForSequenceClassification:
    """Entry point: `AutoDistributedModelForSequenceClassification.from_pretrained(name, num_labels=2, ...)`; the
    other keyword arguments are `AutoDistributedModelForCausalLM.from_pretrained`'s (`tuning_mode`, `pre_seq_len`...)."""

    @classmethod
    def from_pretrained(
        cls, name_or_path: str | os.PathLike, **kwargs: Any
    ) -> DistributedModelForSequenceClassification:
        return load_distributed_model(DistributedModelForSequenceClassification, name_or_path, **kwargs)
