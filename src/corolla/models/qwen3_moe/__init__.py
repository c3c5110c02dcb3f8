"""Qwen3-MoE: Qwen3 attention and a top-k routed mixture of SwiGLU experts (dense layers where configured)."""
