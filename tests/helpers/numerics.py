"""Numerical comparisons shared by the GPU tests."""

from __future__ import annotations

import torch


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """‖a − b‖ / ‖b‖ in float32 (b of norm 0 counts as 1e-12); fails on any non-finite value in `a`."""
    assert torch.isfinite(a).all(), "non-finite output"
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12))
