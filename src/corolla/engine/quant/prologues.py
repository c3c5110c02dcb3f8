"""The prologues a quantized projection's kernel may run on its x before the product, as every kernel codes them
(the Triton kernels' and the NVRTC row GEMVs' PRO): none, or the RMSNorm ahead of w_qkv and w_gate_up. Importing
needs neither Triton nor a GPU."""

from __future__ import annotations

import torch

PROLOGUES = {"none": 0, "rmsnorm": 1}  # the kernels' PRO codes


def check_prologue(k: int, prologue: int, norm_weight: torch.Tensor | None) -> None:
    """ValueError unless `prologue` is a PROLOGUES code and RMSNorm comes with a contiguous [K] gain."""
    if prologue not in PROLOGUES.values():
        raise ValueError(f"unknown prologue code {prologue} (one of {sorted(PROLOGUES.values())})")
    if prologue == PROLOGUES["rmsnorm"] and (
        norm_weight is None or norm_weight.shape != (k,) or norm_weight.stride(0) != 1
    ):
        raise ValueError(f"the RMSNorm prologue needs a contiguous [{k}] gain")
