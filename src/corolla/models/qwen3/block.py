"""The Qwen3 decoder layer: Llama's pre-RMSNorm residual layout and SwiGLU MLP, with GQA attention whose queries
and keys are RMS-normalized per head (`self_attn.q_norm` / `k_norm`, weights `[head_dim]`) before rotary."""

from __future__ import annotations

from corolla.models.llama.block import LlamaBlock


class Qwen3Block(LlamaBlock):
    """Checkpoint names: `self_attn.{q,k,v,o}_proj`, `self_attn.{q,k}_norm`, `mlp.{gate,up,down}_proj`,
    `input_layernorm`, `post_attention_layernorm`."""

    QK_NORM = True
