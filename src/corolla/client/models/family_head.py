"""Client-side details of the families whose embeddings, final norm or logits differ from Llama's: Gemma's
embeddings scaled by sqrt(hidden_size) and (1 + weight) RMSNorm, gpt-oss's RMSNorm (weight applied before the
cast), and final logit soft-capping wherever the config sets `final_logit_softcapping`."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from corolla.models.gemma.block import GemmaRMSNorm
from corolla.models.gpt_oss.block import GptOssRMSNorm
from corolla.models.window_attention import softcap

GEMMA_NORM = "gemma"
GPT_OSS_NORM = "gpt_oss_rms"
_SCALED_EMBEDDINGS = ("gemma2", "gemma3_text")


def family_norm(kind: str, hidden_size: int, config: Any) -> nn.Module | None:
    """The final norm for the kinds defined here; None for the kinds `distributed_model` builds itself."""
    if kind == GEMMA_NORM:
        return GemmaRMSNorm(hidden_size, config.rms_norm_eps)
    if kind == GPT_OSS_NORM:
        return GptOssRMSNorm(hidden_size, config.rms_norm_eps)
    return None


def scale_embeddings(config: Any, hidden: torch.Tensor) -> torch.Tensor:
    """Gemma: embeddings [B, T, H] times sqrt(H) rounded to their dtype (as the reference); others unchanged."""
    if getattr(config, "model_type", None) not in _SCALED_EMBEDDINGS:
        return hidden
    return hidden * torch.tensor(float(config.hidden_size) ** 0.5, dtype=hidden.dtype, device=hidden.device)


def cap_logits(config: Any, logits: torch.Tensor) -> torch.Tensor:
    """cap * tanh(logits / cap) when the config sets `final_logit_softcapping`; unchanged otherwise."""
    cap = getattr(config, "final_logit_softcapping", None)
    return logits if cap is None else softcap(logits, float(cap))
