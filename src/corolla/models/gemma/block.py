"""Gemma 2 and Gemma 3 (text) decoder layers: RMSNorms scaled by (1 + weight) around both sublayers (pre and
post), GQA attention scaled by `query_pre_attn_scalar`**-0.5 with sliding-window layers (`layer_types`), Gemma 2's
attention logit soft-capping, Gemma 3's per-head q/k norms and per-layer-type rope bases, and a GELU-tanh gated
MLP. Embedding scaling, the final norm and final logit soft-capping run on the client."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from corolla.models.attention import DEFAULT_SLIDING_SLACK_TOKENS, Attention
from corolla.models.block_base import CorollaBlock, TensorTarget, same_names
from corolla.models.expert_names import swiglu_layout
from corolla.models.layers import GatedMLP, RMSNorm
from corolla.models.llama.block import QK_NORM_LAYOUT, head_dim_of, num_kv_heads_of, qkv_layout
from corolla.models.positions import RotaryEmbedding, rope_parameters

SLIDING = "sliding_attention"


def layer_type_of(config, layer_idx: int) -> str:
    layer_types = getattr(config, "layer_types", None)
    if not layer_types or layer_idx >= len(layer_types):
        raise ValueError(f"config.layer_types must name layer {layer_idx}'s attention type, got {layer_types!r}")
    return str(layer_types[layer_idx])


def sliding_window_of(config, layer_idx: int) -> int | None:
    """The window of a `sliding_attention` layer, None for full attention."""
    if layer_type_of(config, layer_idx) != SLIDING:
        return None
    return int(config.sliding_window)


def layer_rope_parameters(config, layer_idx: int) -> dict:
    """Gemma 3 keeps one rope dict per layer type (local/global bases); Gemma 2 one dict for all layers."""
    params = getattr(config, "rope_parameters", None)
    layer_type = layer_type_of(config, layer_idx)
    if isinstance(params, dict) and isinstance(params.get(layer_type), dict):
        return rope_parameters(SimpleNamespace(rope_parameters=params[layer_type]))
    return rope_parameters(config)


def make_gemma_attention(config, layer_idx: int, *, qk_norm: bool) -> Attention:
    hd, eps = head_dim_of(config), config.rms_norm_eps
    bias = bool(getattr(config, "attention_bias", False))
    return Attention(
        config.hidden_size, config.num_attention_heads, num_kv_heads_of(config), hd, qkv_bias=bias, out_bias=bias,
        rotary=RotaryEmbedding(hd, layer_rope_parameters(config, layer_idx), config.max_position_embeddings),
        sliding_window=sliding_window_of(config, layer_idx), ring_slack_tokens=DEFAULT_SLIDING_SLACK_TOKENS,
        q_norm=RMSNorm(hd, eps, kind="gemma") if qk_norm else None,
        k_norm=RMSNorm(hd, eps, kind="gemma") if qk_norm else None,
        fp32_scores=True, scale=float(config.query_pre_attn_scalar) ** -0.5,
        logit_softcap=getattr(config, "attn_logit_softcapping", None),
    )  # fmt: skip


class Gemma2Block(CorollaBlock):
    """x + post_attn_norm(attn(input_norm(x))), then + post_ff_norm(mlp(pre_ff_norm(.)))."""

    QK_NORM = False
    NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm")

    def __init__(self, config, layer_idx: int):
        super().__init__(config, layer_idx)
        H, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(H, eps, kind="gemma")
        self.post_attention_layernorm = RMSNorm(H, eps, kind="gemma")
        self.pre_feedforward_layernorm = RMSNorm(H, eps, kind="gemma")
        self.post_feedforward_layernorm = RMSNorm(H, eps, kind="gemma")
        self.attn = make_gemma_attention(config, layer_idx, qk_norm=self.QK_NORM)
        self.mlp = GatedMLP(H, config.intermediate_size, config.hidden_activation)

    def _forward(self, hidden_states: torch.Tensor, *, cache: list[torch.Tensor] | None, position: int) -> torch.Tensor:
        x = hidden_states  # [B, T, H]
        x = x + self.post_attention_layernorm(self.attn(self.input_layernorm(x), cache, position))  # [B, T, H]
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))  # [B, T, H]

    def checkpoint_layout(self) -> dict[str, TensorTarget]:
        bias = bool(getattr(self.config, "attention_bias", False))
        layout = qkv_layout(self.config, qkv_bias=bias, out_bias=bias)
        layout.update(same_names(*(f"{name}.weight" for name in self.NORMS)))
        layout.update(swiglu_layout("mlp", "mlp", self.config.intermediate_size))
        return {**layout, **QK_NORM_LAYOUT} if self.QK_NORM else layout


class Gemma3Block(Gemma2Block):
    """Gemma 2's layer plus per-head RMSNorms on q and k (`self_attn.{q,k}_norm`); soft-capping only if the config
    sets `attn_logit_softcapping`; local (sliding) and global layers rotate with their own rope parameters."""

    QK_NORM = True
