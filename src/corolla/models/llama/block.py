"""The Llama decoder layer (also Mistral and Qwen2): pre-RMSNorm, rotary GQA attention, SwiGLU MLP; and Qwen3's, the
same with queries and keys RMS-normalized per head before rotary."""

from __future__ import annotations

import torch

from corolla.models.attention import Attention
from corolla.models.block_base import CorollaBlock, TensorTarget, same_names
from corolla.models.expert_names import swiglu_layout
from corolla.models.layers import GatedMLP, RMSNorm
from corolla.models.positions import RotaryEmbedding, rope_parameters


def head_dim_of(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def num_kv_heads_of(config) -> int:
    return getattr(config, "num_key_value_heads", None) or config.num_attention_heads


def sliding_window_of(config, layer_idx: int) -> int | None:
    """Mistral: `sliding_window` for every layer; Qwen2: only layers whose `layer_types` entry says so."""
    window = getattr(config, "sliding_window", None)
    if window is None:
        return None
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None and layer_idx < len(layer_types) and layer_types[layer_idx] != "sliding_attention":
        return None
    if getattr(config, "model_type", None) == "qwen2" and not getattr(config, "use_sliding_window", False):
        return None
    return int(window)


def attention_biases(config) -> tuple[bool, bool]:
    """(q/k/v biases, o bias): `attention_bias` for both; Qwen2 has q/k/v biases always."""
    bias = bool(getattr(config, "attention_bias", False))
    return bias or getattr(config, "model_type", None) == "qwen2", bias


def make_rotary_attention(config, layer_idx: int, *, qk_norm: bool = False) -> Attention:
    """Rotary GQA attention; `qk_norm` (Qwen3): RMSNorm over each head's q and k (eps `rms_norm_eps`)."""
    hd = head_dim_of(config)
    qkv_bias, out_bias = attention_biases(config)
    return Attention(
        config.hidden_size, config.num_attention_heads, num_kv_heads_of(config), hd, qkv_bias=qkv_bias,
        out_bias=out_bias, rotary=RotaryEmbedding(hd, rope_parameters(config), config.max_position_embeddings),
        sliding_window=sliding_window_of(config, layer_idx),
        q_norm=RMSNorm(hd, config.rms_norm_eps) if qk_norm else None,
        k_norm=RMSNorm(hd, config.rms_norm_eps) if qk_norm else None,
    )  # fmt: skip


def qkv_layout(config, *, qkv_bias: bool, out_bias: bool) -> dict[str, TensorTarget]:
    """Separate checkpoint q/k/v projections -> row ranges of our fused `attn.qkv`."""
    q_name, k_name, v_name, o_name = "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj"
    hd = head_dim_of(config)
    nq, nkv = config.num_attention_heads * hd, num_kv_heads_of(config) * hd
    rows = {
        q_name: torch.arange(0, nq),
        k_name: torch.arange(nq, nq + nkv),
        v_name: torch.arange(nq + nkv, nq + 2 * nkv),
    }
    layout = {}
    for name, r in rows.items():
        layout[f"{name}.weight"] = TensorTarget("attn.qkv.weight", r)
        if qkv_bias:
            layout[f"{name}.bias"] = TensorTarget("attn.qkv.bias", r)
    layout[f"{o_name}.weight"] = TensorTarget("attn.o_proj.weight")
    if out_bias:
        layout[f"{o_name}.bias"] = TensorTarget("attn.o_proj.bias")
    return layout


# per-head q and k norms (Qwen3, Gemma 3): `self_attn.{q,k}_norm.weight` -> `attn.{q,k}_norm.weight`
QK_NORM_LAYOUT = {f"self_attn.{n}_norm.weight": TensorTarget(f"attn.{n}_norm.weight") for n in "qk"}


class LlamaBlock(CorollaBlock):
    """x + attn(norm(x)), then + mlp(norm(.))."""

    QK_NORM = False  # Qwen3: per-head RMSNorm of queries and keys before rotary

    def __init__(self, config, layer_idx: int):
        super().__init__(config, layer_idx)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attn = self._make_attention(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = self._make_mlp(config)

    def _make_attention(self, config, layer_idx: int):
        return make_rotary_attention(config, layer_idx, qk_norm=self.QK_NORM)

    def _make_mlp(self, config):
        return GatedMLP(
            config.hidden_size,
            config.intermediate_size,
            config.hidden_act,
            bias=bool(getattr(config, "mlp_bias", False)),
        )

    def checkpoint_layout(self) -> dict[str, TensorTarget]:
        inter = self.config.intermediate_size
        layout = {**self.attn_layout(), **same_names("input_layernorm.weight", "post_attention_layernorm.weight")}
        layout.update(swiglu_layout("mlp", "mlp", inter))
        if getattr(self.config, "mlp_bias", False):
            layout["mlp.gate_proj.bias"] = TensorTarget("mlp.gate_up.bias", torch.arange(0, inter))
            layout["mlp.up_proj.bias"] = TensorTarget("mlp.gate_up.bias", torch.arange(inter, 2 * inter))
            layout["mlp.down_proj.bias"] = TensorTarget("mlp.down.bias")
        return layout

    def attn_layout(self) -> dict[str, TensorTarget]:
        qkv_bias, out_bias = attention_biases(self.config)
        layout = qkv_layout(self.config, qkv_bias=qkv_bias, out_bias=out_bias)
        return {**layout, **QK_NORM_LAYOUT} if self.QK_NORM else layout


class Qwen3Block(LlamaBlock):
    QK_NORM = True
