"""The Qwen3-MoE decoder layer: Qwen3's q/k-normed attention, then either a sparse mixture of experts (softmax
router, top `num_experts_per_tok`, renormalized when `norm_topk_prob`) or, for layers in `mlp_only_layers` or off
the `decoder_sparse_step` grid, a dense SwiGLU MLP of `intermediate_size`. Every expert of the layer lives in
this block, so routing never leaves the server holding it."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from corolla.models.block_base import TensorTarget, same_names
from corolla.models.expert_names import experts_layout, unstack_experts
from corolla.models.layers import GatedMLP, SparseMoE
from corolla.models.llama.block import Qwen3Block


def is_sparse_layer(config, layer_idx: int) -> bool:
    """The transformers rule: experts unless the layer is in `mlp_only_layers` or off the sparse step."""
    mlp_only = set(getattr(config, "mlp_only_layers", None) or ())
    step = int(getattr(config, "decoder_sparse_step", 1) or 1)
    return layer_idx not in mlp_only and int(config.num_experts) > 0 and (layer_idx + 1) % step == 0


class Qwen3MoeBlock(Qwen3Block):
    def _make_mlp(self, config) -> nn.Module:
        if not is_sparse_layer(config, self.layer_idx):
            return GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act)
        return SparseMoE(
            config.hidden_size, config.moe_intermediate_size, config.num_experts, config.num_experts_per_tok,
            config.hidden_act, normalize_top_k=bool(config.norm_topk_prob),
        )  # fmt: skip

    @property
    def sparse(self) -> bool:
        return is_sparse_layer(self.config, self.layer_idx)

    def checkpoint_layout(self) -> dict[str, TensorTarget]:
        if not self.sparse:
            return super().checkpoint_layout()  # Llama's dense MLP names with Qwen3's attention
        layout = {
            **self.attn_layout(),
            **same_names("input_layernorm.weight", "post_attention_layernorm.weight"),
            "mlp.gate.weight": TensorTarget("mlp.router.weight"),
        }
        return {**layout, **experts_layout("mlp.experts", self.config.num_experts, self.config.moe_intermediate_size)}

    def normalize_checkpoint_names(self, state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return unstack_experts(state_dict, self.config.moe_intermediate_size)
