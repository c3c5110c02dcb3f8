"""The parameters of a block for per-block memory sizing: every routed expert's bytes sit in the server's memory
(routing stays inside the block: no expert traffic between servers), so a mixture-of-experts block counts all of
them."""

from __future__ import annotations

from typing import Any

import torch

from corolla.models.registry import get_family


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


def _layer_parameters(config: Any, layer_idx: int) -> int:
    with torch.device("meta"):
        block = get_family(config).build_block(config, layer_idx)
    return sum(p.numel() for p in block.parameters())


def count_block_parameters(config: Any) -> int:
    """Parameters of one block (the largest: a routed-experts one when the model mixes dense and MoE layers), for
    per-block memory sizing; counted on the meta device (no memory is used)."""
    return max(_layer_parameters(config, i) for i in representative_layers(config).values())
