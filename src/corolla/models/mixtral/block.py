"""The Mixtral decoder layer: rotary GQA attention and a top-k routed mixture of SwiGLU experts."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from corolla.models.block_base import TensorTarget
from corolla.models.layers import SparseMoE
from corolla.models.llama.block import LlamaBlock


class MixtralBlock(LlamaBlock):
    """Checkpoint names: `self_attn.{q,k,v,o}_proj`, `block_sparse_moe.gate` (router),
    `block_sparse_moe.experts.<e>.{w1,w3,w2}` (gate, up, down), the two RMSNorms. Newer transformers spellings
    (`mlp.gate`, stacked `mlp.experts.gate_up_proj` / `down_proj`) are accepted too."""

    def _make_mlp(self, config):
        return SparseMoE(
            config.hidden_size,
            config.intermediate_size,
            config.num_local_experts,
            config.num_experts_per_tok,
            config.hidden_act,
        )

    def checkpoint_layout(self) -> dict[str, TensorTarget]:
        inter = self.config.intermediate_size
        gate_rows, up_rows = torch.arange(0, inter), torch.arange(inter, 2 * inter)
        layout = {
            **self.attn_layout(),
            "input_layernorm.weight": TensorTarget("input_layernorm.weight"),
            "post_attention_layernorm.weight": TensorTarget("post_attention_layernorm.weight"),
            "block_sparse_moe.gate.weight": TensorTarget("mlp.router.weight"),
        }
        for e in range(self.config.num_local_experts):
            ours, theirs = f"mlp.experts.{e}", f"block_sparse_moe.experts.{e}"
            layout[f"{theirs}.w1.weight"] = TensorTarget(f"{ours}.gate_up.weight", gate_rows)
            layout[f"{theirs}.w3.weight"] = TensorTarget(f"{ours}.gate_up.weight", up_rows)
            layout[f"{theirs}.w2.weight"] = TensorTarget(f"{ours}.down.weight")
        return layout

    def normalize_checkpoint_names(self, state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        result = dict(state_dict)
        inter = self.config.intermediate_size
        if "mlp.gate.weight" in result:
            result["block_sparse_moe.gate.weight"] = result.pop("mlp.gate.weight")
        if "mlp.experts.gate_up_proj" in result:
            stacked = result.pop("mlp.experts.gate_up_proj")  # [E, 2I, H]
            for e in range(stacked.shape[0]):
                result[f"block_sparse_moe.experts.{e}.w1.weight"] = stacked[e, :inter]
                result[f"block_sparse_moe.experts.{e}.w3.weight"] = stacked[e, inter:]
        if "mlp.experts.down_proj" in result:
            stacked = result.pop("mlp.experts.down_proj")  # [E, H, I]
            for e in range(stacked.shape[0]):
                result[f"block_sparse_moe.experts.{e}.w2.weight"] = stacked[e]
        return result
