"""The Falcon decoder layer: LayerNorm(s), fused-qkv attention (rotary or ALiBi), dense GELU MLP, with attention
and MLP in parallel (new architecture, `parallel_attn`) or in sequence."""

from __future__ import annotations

import math

import torch
from torch import nn

from corolla.models.attention import Attention, grouped_qkv_rows, interleaved_qkv_rows
from corolla.models.block_base import CorollaBlock, TensorTarget
from corolla.models.layers import DenseMLP
from corolla.models.positions import RotaryEmbedding, rope_parameters


def falcon_kv_heads(config) -> int:
    if config.new_decoder_architecture:
        return config.num_kv_heads
    return 1 if config.multi_query else config.num_attention_heads


class FalconBlock(CorollaBlock):
    def __init__(self, config, layer_idx: int):
        super().__init__(config, layer_idx)
        H, heads = config.hidden_size, config.num_attention_heads
        hd = H // heads
        self.new_arch = bool(config.new_decoder_architecture)
        self.parallel = bool(config.parallel_attn)
        self.num_ln = getattr(config, "num_ln_in_parallel_attn", None) or (2 if self.new_arch else 1)
        if self.new_arch and not self.parallel:
            raise ValueError("Falcon new_decoder_architecture requires parallel_attn=True")
        eps = config.layer_norm_epsilon
        if not self.parallel:
            self.input_layernorm = nn.LayerNorm(H, eps=eps)
            self.post_attention_layernorm = nn.LayerNorm(H, eps=eps)
        elif self.new_arch and self.num_ln == 2:
            self.ln_attn = nn.LayerNorm(H, eps=eps)
            self.ln_mlp = nn.LayerNorm(H, eps=eps)
        else:
            self.input_layernorm = nn.LayerNorm(H, eps=eps)
        alibi = bool(config.alibi)
        rotary = None if alibi else RotaryEmbedding(hd, rope_parameters(config), config.max_position_embeddings)
        self.attn = Attention(
            H, heads, falcon_kv_heads(config), hd, qkv_bias=bool(config.bias), out_bias=bool(config.bias),
            rotary=rotary, alibi=alibi, alibi_scale=1.0 / math.sqrt(hd), alibi_bf16_product=True,
        )  # fmt: skip
        ffn = getattr(config, "ffn_hidden_size", None) or 4 * H
        self.mlp = DenseMLP(H, ffn, getattr(config, "activation", "gelu"), bias=bool(config.bias))

    def _forward(self, hidden_states: torch.Tensor, *, cache: list[torch.Tensor] | None, position: int) -> torch.Tensor:
        x = hidden_states  # [B, T, H]
        if self.new_arch and self.num_ln == 2:
            attn_in, mlp_in = self.ln_attn(x), self.ln_mlp(x)  # [B, T, H] each
        else:
            attn_in = mlp_in = self.input_layernorm(x)
        attn_out = self.attn(attn_in, cache, position)  # [B, T, H]
        if not self.parallel:
            x = x + attn_out
            return x + self.mlp(self.post_attention_layernorm(x))
        return x + (self.mlp(mlp_in) + attn_out)

    def checkpoint_layout(self) -> dict[str, TensorTarget]:
        c = self.config
        heads, hd = c.num_attention_heads, c.hidden_size // c.num_attention_heads
        if self.new_arch:
            rows = grouped_qkv_rows(heads, c.num_kv_heads, hd)
        elif c.multi_query:
            rows = None  # already [q heads | k | v]
        else:
            rows = interleaved_qkv_rows(heads, hd)
        pairs = {
            "self_attention.query_key_value": ("attn.qkv", rows),
            "self_attention.dense": ("attn.o_proj", None),
            "mlp.dense_h_to_4h": ("mlp.up", None),
            "mlp.dense_4h_to_h": ("mlp.down", None),
        }
        layout = {}
        for theirs, (ours, r) in pairs.items():
            layout[f"{theirs}.weight"] = TensorTarget(f"{ours}.weight", r)
            if c.bias:
                layout[f"{theirs}.bias"] = TensorTarget(f"{ours}.bias", r)
        for norm in ("ln_attn", "ln_mlp", "input_layernorm", "post_attention_layernorm"):
            if hasattr(self, norm):
                layout[f"{norm}.weight"] = TensorTarget(f"{norm}.weight")
                layout[f"{norm}.bias"] = TensorTarget(f"{norm}.bias")
        return layout
