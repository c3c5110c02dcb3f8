"""The Qwen3 decoder layer: Llama's pre-RMSNorm residual layout and SwiGLU MLP, with GQA attention whose queries
and keys are RMS-normalized per head (`self_attn.q_norm` / `k_norm`, weights `[head_dim]`) before rotary."""

from __future__ import annotations

from corolla.models.attention import Attention
from corolla.models.block_base import TensorTarget
from corolla.models.llama.block import LlamaBlock, head_dim_of, num_kv_heads_of, qkv_layout, sliding_window_of
from corolla.models.positions import RotaryEmbedding, rope_parameters


def make_qk_norm_attention(config, layer_idx: int) -> Attention:
    """Rotary GQA attention with per-head q/k RMSNorm (eps = `rms_norm_eps`), biases per `attention_bias`."""
    hd = head_dim_of(config)
    bias = bool(getattr(config, "attention_bias", False))
    return Attention(
        config.hidden_size,
        config.num_attention_heads,
        num_kv_heads_of(config),
        hd,
        qkv_bias=bias,
        out_bias=bias,
        rotary=RotaryEmbedding(hd, rope_parameters(config), config.max_position_embeddings),
        sliding_window=sliding_window_of(config, layer_idx),
        qk_norm_eps=float(config.rms_norm_eps),
    )


def qk_norm_attn_layout(config) -> dict[str, TensorTarget]:
    """Checkpoint names of Qwen3 attention, as transformers stores them, -> our parameters."""
    bias = bool(getattr(config, "attention_bias", False))
    layout = qkv_layout(
        config, "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
        qkv_bias=bias, out_bias=bias,
    )  # fmt: skip
    layout["self_attn.q_norm.weight"] = TensorTarget("attn.q_norm.weight")
    layout["self_attn.k_norm.weight"] = TensorTarget("attn.k_norm.weight")
    return layout


class Qwen3Block(LlamaBlock):
    """Checkpoint names: `self_attn.{q,k,v,o}_proj`, `self_attn.{q,k}_norm`, `mlp.{gate,up,down}_proj`,
    `input_layernorm`, `post_attention_layernorm`."""

    def _make_attention(self, config, layer_idx: int) -> Attention:
        return make_qk_norm_attention(config, layer_idx)

    def attn_layout(self) -> dict[str, TensorTarget]:
        return qk_norm_attn_layout(self.config)
