"""The Mixtral decoder layer: rotary GQA attention and a top-k routed mixture of SwiGLU experts."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from corolla.models.block_base import TensorTarget, same_names
from corolla.models.expert_names import experts_layout, unstack_experts
from corolla.models.layers import SparseMoE
from corolla.models.llama.block import LlamaBlock

_STORED_EXPERTS = "block_sparse_moe.experts"
_MIXTRAL_NAMES = ("w1", "w3", "w2")  # gate, up, down


class MixtralBlock(LlamaBlock):
    """Newer transformers spellings (`mlp.gate`, stacked `mlp.experts.gate_up_proj` / `down_proj`) are accepted
    beside the checkpoints' `block_sparse_moe` names."""

    def _make_mlp(self, config):
        return SparseMoE(
            config.hidden_size, config.intermediate_size, config.num_local_experts, config.num_experts_per_tok,
            config.hidden_act,
        )  # fmt: skip

    def checkpoint_layout(self) -> dict[str, TensorTarget]:
        layout = {
            **self.attn_layout(),
            **same_names("input_layernorm.weight", "post_attention_layernorm.weight"),
            "block_sparse_moe.gate.weight": TensorTarget("mlp.router.weight"),
        }
        inter, experts = self.config.intermediate_size, self.config.num_local_experts
        return {**layout, **experts_layout(_STORED_EXPERTS, experts, inter, _MIXTRAL_NAMES)}

    def normalize_checkpoint_names(self, state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        result = unstack_experts(state_dict, self.config.intermediate_size, _STORED_EXPERTS, _MIXTRAL_NAMES)
        if "mlp.gate.weight" in result:
            result["block_sparse_moe.gate.weight"] = result.pop("mlp.gate.weight")
        return result
