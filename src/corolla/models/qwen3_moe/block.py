"""The Qwen3-MoE decoder layer: Qwen3's q/k-normed attention, then either a sparse mixture of experts (softmax
router, top `num_experts_per_tok`, renormalized when `norm_topk_prob`) or, for layers in `mlp_only_layers` or off
the `decoder_sparse_step` grid, a dense SwiGLU MLP of `intermediate_size`. Every expert of the layer lives in
this block, so routing never leaves the server holding it."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from corolla.models.block_base import TensorTarget
from corolla.models.layers import GatedMLP, SparseMoE
from corolla.models.qwen3.block import Qwen3Block
from corolla.models.registry import qwen3_moe_sparse_layer


def is_sparse_layer(config, layer_idx: int) -> bool:
    """The transformers rule: experts unless the layer is in `mlp_only_layers` or off the sparse step."""
    return qwen3_moe_sparse_layer(config, layer_idx)


class Qwen3MoeBlock(Qwen3Block):
    """Checkpoint names: Qwen3 attention, `mlp.gate` (router) and `mlp.experts.<e>.{gate,up,down}_proj` for sparse
    layers (stacked `mlp.experts.gate_up_proj` / `down_proj` accepted too), `mlp.{gate,up,down}_proj` for dense
    ones, the two RMSNorms."""

    def _make_mlp(self, config) -> nn.Module:
        if not is_sparse_layer(config, self.layer_idx):
            return GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act)
        return SparseMoE(
            config.hidden_size,
            config.moe_intermediate_size,
            config.num_experts,
            config.num_experts_per_tok,
            config.hidden_act,
            normalize_top_k=bool(config.norm_topk_prob),
        )

    @property
    def sparse(self) -> bool:
        return is_sparse_layer(self.config, self.layer_idx)

    def checkpoint_layout(self) -> dict[str, TensorTarget]:
        if not self.sparse:
            return super().checkpoint_layout()  # Llama's dense MLP names with Qwen3's attention
        inter = self.config.moe_intermediate_size
        gate_rows, up_rows = torch.arange(0, inter), torch.arange(inter, 2 * inter)
        layout = {
            **self.attn_layout(),
            "input_layernorm.weight": TensorTarget("input_layernorm.weight"),
            "post_attention_layernorm.weight": TensorTarget("post_attention_layernorm.weight"),
            "mlp.gate.weight": TensorTarget("mlp.router.weight"),
        }
        for e in range(self.config.num_experts):
            ours, theirs = f"mlp.experts.{e}", f"mlp.experts.{e}"
            layout[f"{theirs}.gate_proj.weight"] = TensorTarget(f"{ours}.gate_up.weight", gate_rows)
            layout[f"{theirs}.up_proj.weight"] = TensorTarget(f"{ours}.gate_up.weight", up_rows)
            layout[f"{theirs}.down_proj.weight"] = TensorTarget(f"{ours}.down.weight")
        return layout

    def normalize_checkpoint_names(self, state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return unstack_experts(state_dict, self.config.moe_intermediate_size)


def unstack_experts(state_dict: Mapping[str, torch.Tensor], inter: int) -> dict[str, torch.Tensor]:
    """transformers 5's in-memory layout (`mlp.experts.gate_up_proj` [E, 2I, H], `mlp.experts.down_proj`
    [E, H, I]) -> the per-expert names checkpoints on the hub use."""
    result = dict(state_dict)
    if "mlp.experts.gate_up_proj" in result:
        stacked = result.pop("mlp.experts.gate_up_proj")  # [E, 2I, H]
        for e in range(stacked.shape[0]):
            result[f"mlp.experts.{e}.gate_proj.weight"] = stacked[e, :inter]
            result[f"mlp.experts.{e}.up_proj.weight"] = stacked[e, inter:]
    if "mlp.experts.down_proj" in result:
        stacked = result.pop("mlp.experts.down_proj")  # [E, H, I]
        for e in range(stacked.shape[0]):
            result[f"mlp.experts.{e}.down_proj.weight"] = stacked[e]
    return result
