"""YaRN rotary scaling (gpt-oss, DeepSeek-V3 style configs): per-frequency blend of interpolated and extrapolated
inverse frequencies with a linear ramp between the `beta_fast` and `beta_slow` rotation counts, and the attention
factor that scales cos/sin."""

from __future__ import annotations

import math
from typing import Any

import torch


def _mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_attention_factor(params: dict[str, Any], max_position_embeddings: int) -> float:
    """The multiplier applied to cos and sin: `attention_factor` when given, else from `factor` (and the
    `mscale` / `mscale_all_dim` ratio when both are set)."""
    given = params.get("attention_factor")
    if given is not None:
        return float(given)
    factor = _factor(params, max_position_embeddings)
    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return _mscale(factor, float(mscale)) / _mscale(factor, float(mscale_all_dim))
    return _mscale(factor)


def _factor(params: dict[str, Any], max_position_embeddings: int) -> float:
    factor = params.get("factor")
    if factor is None:
        return max_position_embeddings / float(params["original_max_position_embeddings"])
    return float(factor)


def _correction_dim(rotations: float, dim: int, base: float, original_length: float) -> float:
    """The rotary dimension index whose wavelength completes `rotations` turns over `original_length` tokens."""
    return dim * math.log(original_length / (rotations * 2 * math.pi)) / (2 * math.log(base))


def yarn_inv_freq(dim: int, params: dict[str, Any], max_position_embeddings: int, device: torch.device) -> torch.Tensor:
    """[dim/2] fp32 inverse frequencies: dimensions below the ramp keep their frequency (extrapolation), those
    above are divided by `factor` (interpolation), a linear ramp in between."""
    base = float(params["rope_theta"])
    factor = _factor(params, max_position_embeddings)
    original_length = float(params["original_max_position_embeddings"])
    beta_fast = float(params.get("beta_fast") or 32)
    beta_slow = float(params.get("beta_slow") or 1)
    low = _correction_dim(beta_fast, dim, base, original_length)
    high = _correction_dim(beta_slow, dim, base, original_length)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # the ramp needs a non-empty interval
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim  # [dim/2]
    pos_freqs = base**exponents
    extrapolated, interpolated = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device=device) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # [dim/2]: 1 keeps the original frequency
    return interpolated * (1 - keep) + extrapolated * keep
