"""The DeepSeek-V3 decoder layer: pre-RMSNorm residual layout around multi-head latent attention (`mla.py`) and,
from layer `first_k_dense_replace` on, the routed + shared experts of `moe.py` (before it, a dense SwiGLU MLP of
`intermediate_size`). The KV cache holds the compressed latent and the shared rotary key per token."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from corolla.models.block_base import CorollaBlock, TensorTarget, same_names
from corolla.models.deepseek_v3.mla import LatentAttention
from corolla.models.deepseek_v3.moe import GroupLimitedMoE
from corolla.models.expert_names import swiglu_layout, unstack_experts
from corolla.models.layers import GatedMLP, RMSNorm


def is_moe_layer(config, layer_idx: int) -> bool:
    """Experts from layer `first_k_dense_replace` on."""
    return layer_idx >= int(config.first_k_dense_replace) and int(config.n_routed_experts) > 0


class DeepseekV3Block(CorollaBlock):
    def __init__(self, config, layer_idx: int):
        super().__init__(config, layer_idx)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attn = LatentAttention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp: nn.Module
        if is_moe_layer(config, layer_idx):
            self.mlp = GroupLimitedMoE(config)
        else:
            self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act)

    def checkpoint_layout(self) -> dict[str, TensorTarget]:
        config = self.config
        layout = same_names("input_layernorm.weight", "post_attention_layernorm.weight")
        attn_names = ["kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "o_proj"]
        attn_names += ["q_proj"] if config.q_lora_rank is None else ["q_a_proj", "q_a_layernorm", "q_b_proj"]
        for name in attn_names:
            layout[f"self_attn.{name}.weight"] = TensorTarget(f"attn.{name}.weight")
        if getattr(config, "attention_bias", False):
            for name in ["kv_a_proj_with_mqa", "o_proj"] + ([] if config.q_lora_rank is None else ["q_a_proj"]):
                layout[f"self_attn.{name}.bias"] = TensorTarget(f"attn.{name}.bias")
        if not is_moe_layer(config, self.layer_idx):
            return {**layout, **swiglu_layout("mlp", "mlp", int(config.intermediate_size))}
        inter = int(config.moe_intermediate_size)
        layout["mlp.gate.weight"] = TensorTarget("mlp.router.weight")
        layout["mlp.gate.e_score_correction_bias"] = TensorTarget("mlp.e_score_correction_bias")
        for e in range(int(config.n_routed_experts)):
            layout.update(swiglu_layout(f"mlp.experts.{e}", f"mlp.experts.{e}", inter))
        layout.update(swiglu_layout("mlp.shared_experts", "mlp.shared_experts", inter * int(config.n_shared_experts)))
        return layout

    def normalize_checkpoint_names(self, state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return unstack_experts(state_dict, int(self.config.moe_intermediate_size))
