"""Checkpoint names of SwiGLU MLPs and mixture-of-experts layers, shared by the MoE families (Mixtral, Qwen3-MoE,
DeepSeek-V3): how a stored gate/up/down triple maps onto our fused `gate_up` + `down` weights, and how transformers 5's
stacked expert tensors unfold into the per-expert names checkpoints on the hub use."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from corolla.models.block_base import TensorTarget

HF_SWIGLU_NAMES = ("gate_proj", "up_proj", "down_proj")  # Llama-style names; Mixtral stores w1, w3, w2


def swiglu_layout(
    theirs: str, ours: str, inter: int, names: tuple[str, str, str] = HF_SWIGLU_NAMES
) -> dict[str, TensorTarget]:
    """`{theirs}.{gate,up,down}.weight` -> rows [0, I) and [I, 2I) of `{ours}.gate_up.weight`, and `{ours}.down.weight`."""
    gate, up, down = names
    return {
        f"{theirs}.{gate}.weight": TensorTarget(f"{ours}.gate_up.weight", torch.arange(0, inter)),
        f"{theirs}.{up}.weight": TensorTarget(f"{ours}.gate_up.weight", torch.arange(inter, 2 * inter)),
        f"{theirs}.{down}.weight": TensorTarget(f"{ours}.down.weight"),
    }


def experts_layout(
    stored_prefix: str, num_experts: int, inter: int, names: tuple[str, str, str] = HF_SWIGLU_NAMES
) -> dict[str, TensorTarget]:
    """Every expert `e` of a layer: `{stored_prefix}.{e}.*` -> our `mlp.experts.{e}.*`."""
    layout: dict[str, TensorTarget] = {}
    for e in range(num_experts):
        layout.update(swiglu_layout(f"{stored_prefix}.{e}", f"mlp.experts.{e}", inter, names))
    return layout


def unstack_experts(
    state_dict: Mapping[str, torch.Tensor],
    inter: int,
    stored_prefix: str = "mlp.experts",
    names: tuple[str, str, str] = HF_SWIGLU_NAMES,
) -> dict[str, torch.Tensor]:
    """transformers 5's in-memory layout (`mlp.experts.gate_up_proj` [E, 2I, H], `mlp.experts.down_proj` [E, H, I])
    -> the per-expert names checkpoints on the hub use (`{stored_prefix}.{e}.{gate,up,down}.weight`)."""
    gate, up, down = names
    result = dict(state_dict)
    if "mlp.experts.gate_up_proj" in result:
        stacked = result.pop("mlp.experts.gate_up_proj")  # [E, 2I, H]
        for e in range(stacked.shape[0]):
            result[f"{stored_prefix}.{e}.{gate}.weight"] = stacked[e, :inter]
            result[f"{stored_prefix}.{e}.{up}.weight"] = stacked[e, inter:]
    if "mlp.experts.down_proj" in result:
        stacked = result.pop("mlp.experts.down_proj")  # [E, H, I]
        for e in range(stacked.shape[0]):
            result[f"{stored_prefix}.{e}.{down}.weight"] = stacked[e]
    return result
