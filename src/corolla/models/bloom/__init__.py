"""BLOOM family: ALiBi multi-head attention with a per-head fused q/k/v projection."""

from corolla.models.bloom.block import BloomBlock

__all__ = ["BloomBlock"]
