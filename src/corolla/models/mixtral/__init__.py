"""Mixtral family: the Llama attention with a sparse mixture-of-experts MLP (top-k routing)."""

from corolla.models.mixtral.block import MixtralBlock

__all__ = ["MixtralBlock"]
