"""OpenAI gpt-oss decoder layers (attention sinks, alternating sliding/full attention, clamped-SwiGLU MoE)."""

from corolla.models.gpt_oss.block import GptOssBlock, GptOssExperts, GptOssMoE

__all__ = ["GptOssBlock", "GptOssExperts", "GptOssMoE"]
