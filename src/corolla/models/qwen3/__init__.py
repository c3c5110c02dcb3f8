"""Qwen3 (dense): the Llama layer with RMSNorm over each head's queries and keys."""

from corolla.models.qwen3.block import Qwen3Block

__all__ = ["Qwen3Block"]
