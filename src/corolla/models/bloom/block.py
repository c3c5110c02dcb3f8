"""The BLOOM decoder layer: LayerNorm, ALiBi attention (bias = slope x key position), tanh-GELU MLP."""

from __future__ import annotations

import torch
from torch import nn

from corolla.models.attention import Attention, interleaved_qkv_rows
from corolla.models.block_base import CorollaBlock, TensorTarget
from corolla.models.layers import DenseMLP


class BloomBlock(CorollaBlock):
    def __init__(self, config, layer_idx: int):
        super().__init__(config, layer_idx)
        H, heads = config.hidden_size, config.n_head
        eps = config.layer_norm_epsilon
        self.residual_after_norm = bool(config.apply_residual_connection_post_layernorm)
        self.input_layernorm = nn.LayerNorm(H, eps=eps)
        self.attn = Attention(H, heads, heads, H // heads, qkv_bias=True, out_bias=True, alibi=True, alibi_scale=1.0)
        self.post_attention_layernorm = nn.LayerNorm(H, eps=eps)
        self.mlp = DenseMLP(H, 4 * H, "gelu_pytorch_tanh", bias=True)

    def _forward(self, hidden_states: torch.Tensor, *, cache: list[torch.Tensor] | None, position: int) -> torch.Tensor:
        x = hidden_states  # [B, T, H]
        normed = self.input_layernorm(x)
        x = self.attn(normed, cache, position) + (normed if self.residual_after_norm else x)  # [B, T, H]
        normed = self.post_attention_layernorm(x)
        return self.mlp(normed) + (normed if self.residual_after_norm else x)  # [B, T, H]

    def checkpoint_layout(self) -> dict[str, TensorTarget]:
        c = self.config
        rows = interleaved_qkv_rows(c.n_head, c.hidden_size // c.n_head)
        layout = {}
        for theirs, ours, r in (
            ("self_attention.query_key_value", "attn.qkv", rows),
            ("self_attention.dense", "attn.o_proj", None),
            ("mlp.dense_h_to_4h", "mlp.up", None),
            ("mlp.dense_4h_to_h", "mlp.down", None),
            ("input_layernorm", "input_layernorm", None),
            ("post_attention_layernorm", "post_attention_layernorm", None),
        ):
            layout[f"{theirs}.weight"] = TensorTarget(f"{ours}.weight", r)
            layout[f"{theirs}.bias"] = TensorTarget(f"{ours}.bias", r)
        return layout
