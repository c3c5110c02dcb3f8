"""Gemma 2 and Gemma 3 (text) decoder layers."""

from corolla.models.gemma.block import Gemma2Block, Gemma3Block, GemmaRMSNorm

__all__ = ["Gemma2Block", "Gemma3Block", "GemmaRMSNorm"]
