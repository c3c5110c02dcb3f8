"""Qwen3-MoE: Qwen3 attention and a top-k routed mixture of SwiGLU experts (dense layers where configured)."""

from corolla.models.qwen3_moe.block import Qwen3MoeBlock

__all__ = ["Qwen3MoeBlock"]
