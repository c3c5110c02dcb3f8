"""The gpt-oss decoder layer: pre-RMSNorm; GQA attention with q/k/v/o biases, learned per-head sink logits,
YaRN rotary and a 128-token window on every other layer; and a mixture of experts: router (with bias) -> top-k
logits -> softmax over the chosen, each expert a clamped SwiGLU `(up + 1) * gate * sigmoid(alpha * gate)` with
biases. Expert weights stay stacked as the checkpoint stores them (`[E, H, 2I]` with gate/up interleaved by
column, `[E, I, H]`); routing is local to the block, so no expert traffic leaves the server."""

from __future__ import annotations

import functools
from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from corolla.models.attention import DEFAULT_SLIDING_SLACK_TOKENS, Attention
from corolla.models.block_base import CorollaBlock, TensorTarget, same_names
from corolla.models.gemma.block import sliding_window_of
from corolla.models.gpt_oss.mxfp4 import dequantize_expert_tensors
from corolla.models.layers import RMSNorm, mix_experts
from corolla.models.llama.block import head_dim_of, num_kv_heads_of, qkv_layout
from corolla.models.positions import RotaryEmbedding, rope_parameters


class GptOssExperts(nn.Module):
    """E clamped-SwiGLU experts, stacked as stored: `gate_up_proj` [E, H, 2I] (even columns gate, odd up),
    `gate_up_proj_bias` [E, 2I], `down_proj` [E, I, H], `down_proj_bias` [E, H]."""

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, alpha: float, limit: float):
        super().__init__()
        self.alpha, self.limit = alpha, limit
        self.gate_up_proj = nn.Parameter(torch.zeros(num_experts, hidden_size, 2 * intermediate_size))
        self.gate_up_proj_bias = nn.Parameter(torch.zeros(num_experts, 2 * intermediate_size))
        self.down_proj = nn.Parameter(torch.zeros(num_experts, intermediate_size, hidden_size))
        self.down_proj_bias = nn.Parameter(torch.zeros(num_experts, hidden_size))

    def run(self, e: int, x: torch.Tensor) -> torch.Tensor:  # expert e: [n, H] -> [n, H]
        gate_up = x @ self.gate_up_proj[e] + self.gate_up_proj_bias[e]  # [n, 2I]
        gate = gate_up[..., ::2].clamp(max=self.limit)  # [n, I]
        up = gate_up[..., 1::2].clamp(min=-self.limit, max=self.limit)  # [n, I]
        glu = gate * torch.sigmoid(gate * self.alpha)
        return ((up + 1) * glu) @ self.down_proj[e] + self.down_proj_bias[e]  # [n, H]


class GptOssMoE(nn.Module):
    """Top-k experts per token: `router` [E, H] + bias, softmax over the k largest logits, `experts`."""

    def __init__(
        self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int, alpha: float, limit: float
    ):
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok must be in [1, {num_experts}], got {top_k}")
        self.num_experts, self.top_k = num_experts, top_k
        self.router = nn.Linear(hidden_size, num_experts, bias=True)
        self.experts = GptOssExperts(hidden_size, intermediate_size, num_experts, alpha, limit)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, T, H] -> [B, T, H]
        B, T, H = x.shape
        flat = x.reshape(B * T, H)  # [N, H]
        logits = F.linear(flat, self.router.weight, self.router.bias)  # [N, E]
        top_logits, top_i = torch.topk(logits, self.top_k, dim=-1)  # [N, k]
        top_w = torch.softmax(top_logits, dim=-1)  # [N, k], softmax over the chosen experts only
        chosen = ((e, functools.partial(self.experts.run, e)) for e in torch.unique(top_i).tolist())
        return mix_experts(flat, top_w, top_i, chosen).reshape(B, T, H)


class GptOssBlock(CorollaBlock):
    """x + attn(norm(x)), then + moe(norm(.))."""

    def __init__(self, config, layer_idx: int):
        super().__init__(config, layer_idx)
        H, hd = config.hidden_size, head_dim_of(config)
        self.input_layernorm = RMSNorm(H, config.rms_norm_eps, kind="gpt_oss")
        self.post_attention_layernorm = RMSNorm(H, config.rms_norm_eps, kind="gpt_oss")
        bias = bool(getattr(config, "attention_bias", True))
        self.attn = Attention(
            H, config.num_attention_heads, num_kv_heads_of(config), hd, qkv_bias=bias, out_bias=bias,
            rotary=RotaryEmbedding(hd, rope_parameters(config), config.max_position_embeddings),
            sliding_window=sliding_window_of(config, layer_idx), ring_slack_tokens=DEFAULT_SLIDING_SLACK_TOKENS,
            fp32_scores=True, sinks=True,
        )  # fmt: skip
        self.mlp = GptOssMoE(
            H, config.intermediate_size, config.num_local_experts, config.num_experts_per_tok,
            float(config.swiglu_alpha), float(config.swiglu_limit),
        )  # fmt: skip

    def checkpoint_layout(self) -> dict[str, TensorTarget]:
        bias = bool(getattr(self.config, "attention_bias", True))
        layout = qkv_layout(self.config, qkv_bias=bias, out_bias=bias)
        layout["self_attn.sinks"] = TensorTarget("attn.sinks")
        experts = (
            f"mlp.experts.{name}" for name in ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")
        )
        layout.update(same_names("input_layernorm.weight", "post_attention_layernorm.weight", *experts))
        return {**layout, **same_names("mlp.router.weight", "mlp.router.bias")}

    def normalize_checkpoint_names(self, state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """OpenAI's MXFP4 checkpoints store the experts' matrices as `*_blocks` + `*_scales`: dequantized here."""
        return dequantize_expert_tensors(dict(state_dict), ("mlp.experts.gate_up_proj", "mlp.experts.down_proj"))
