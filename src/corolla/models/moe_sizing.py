"""Memory versus compute of mixture-of-experts spans: every routed expert's bytes sit in the server's memory, only
the `num_experts_per_tok` chosen per token are computed; routing stays inside the block (no expert traffic between
servers). `span_parameter_split` counts, per span, all parameters, the routed experts' share of them, and the
parameters one token touches, so block selection and the throughput floor count the right bytes."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from corolla.models.deepseek_v3.moe import GroupLimitedMoE
from corolla.models.gpt_oss.block import GptOssMoE
from corolla.models.layers import SparseMoE
from corolla.models.registry import get_family

ROUTED_EXPERT_PREFIX = "mlp.experts."  # routed experts' parameters in every MoE block (shared experts excluded)


@dataclass(frozen=True)
class SpanParameterSplit:
    """Parameter counts of a span of blocks."""

    total_params: int  # all parameters (what memory holds)
    routed_expert_params: int  # the routed experts' parameters among them
    active_params: int  # parameters one token's forward pass reads (non-expert + its top-k experts)

    def bytes(self, bytes_per_value: float) -> tuple[int, int]:
        """(memory bytes, active bytes per token) at `bytes_per_value` (e.g. 2 for bf16, 4.25/8 for nf4)."""
        return round(self.total_params * bytes_per_value), round(self.active_params * bytes_per_value)


def representative_layers(config: Any) -> dict[bool, int]:
    """{is_sparse: the first layer of that kind}: one dense and/or one sparse layer stand for all of them."""
    family = get_family(config)
    kinds: dict[bool, int] = {}
    for i in range(int(config.num_hidden_layers)):
        sparse = family.is_sparse_layer(config, i) if family.is_sparse_layer is not None else False
        kinds.setdefault(sparse, i)
        if len(kinds) == 2:
            break
    return kinds


def _layer_split(config: Any, layer_idx: int) -> SpanParameterSplit:
    with torch.device("meta"):
        block = get_family(config).build_block(config, layer_idx)
    total = experts = 0
    for name, p in block.named_parameters():
        total += p.numel()
        if name.startswith(ROUTED_EXPERT_PREFIX):
            experts += p.numel()
    mlp = block.get_submodule("mlp")
    active = total
    if isinstance(mlp, (SparseMoE, GroupLimitedMoE, GptOssMoE)):  # a token reads top_k of num_experts routed experts
        active = total - experts + experts * mlp.top_k // mlp.num_experts
    return SpanParameterSplit(total, experts, active)


def span_parameter_split(config: Any, block_indices: Sequence[int]) -> SpanParameterSplit:
    """Counts for the blocks `block_indices` (built on the meta device: no memory is used)."""
    family = get_family(config)
    per_kind = {sparse: _layer_split(config, i) for sparse, i in representative_layers(config).items()}
    total = experts = active = 0
    for i in block_indices:
        if not 0 <= i < int(config.num_hidden_layers):
            raise ValueError(f"block index {i} is outside the model's {config.num_hidden_layers} blocks")
        sparse = family.is_sparse_layer(config, i) if family.is_sparse_layer is not None else False
        split = per_kind[sparse]
        total, experts, active = (
            total + split.total_params,
            experts + split.routed_expert_params,
            active + split.active_params,
        )
    return SpanParameterSplit(total, experts, active)


def count_block_parameters(config: Any) -> int:
    """Parameters of one block (the largest: a routed-experts one when the model mixes dense and MoE layers), for
    per-block memory sizing; counted on the meta device (no memory is used)."""
    return max(_layer_split(config, i).total_params for i in representative_layers(config).values())
