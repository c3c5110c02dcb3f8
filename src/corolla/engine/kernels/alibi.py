"""The ALiBi attention bias of Falcon and BLOOM spans (`Alibi`: per-head slopes, scale and rounding mode), shared by
the torch reference ops (`ops.decode_ops`) and the Triton kernels (`alibi_triton` reads the same modes)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

# how an ALiBi bias is rounded (the triton kernel's ALIBI codes): product kept in fp32; rounded to bf16 / fp16 (BLOOM
# rounds its fp32 bias to the model dtype); positions and product rounded to bf16 (Falcon builds it in bfloat16)
ALIBI_FP32, ALIBI_BF16, ALIBI_FP16, ALIBI_FALCON_BF16 = 1, 2, 3, 4


@dataclass(frozen=True)
class Alibi:
    """ALiBi attention bias: query head h adds `round(slopes[h] * key_position) * scale` to its scores (absolute
    key positions: softmax is shift-invariant, so this equals the relative form), rounded as `mode` says."""

    slopes: torch.Tensor  # [nq] fp32 (Falcon: values already rounded to bf16)
    scale: float
    mode: int  # ALIBI_FP32 / ALIBI_BF16 / ALIBI_FP16 / ALIBI_FALCON_BF16

    def __post_init__(self) -> None:
        if self.mode not in (ALIBI_FP32, ALIBI_BF16, ALIBI_FP16, ALIBI_FALCON_BF16):
            raise ValueError(f"unknown ALiBi rounding mode {self.mode}")

    def bias(self, key_positions: torch.Tensor) -> torch.Tensor:
        """key_positions [L] (any integer dtype) -> bias [nq, L] fp32."""
        pos = key_positions.float()  # [L]
        if self.mode == ALIBI_FALCON_BF16:
            pos = pos.bfloat16().float()
        product = self.slopes.float()[:, None] * pos[None, :]  # [nq, L]
        if self.mode in (ALIBI_BF16, ALIBI_FALCON_BF16):
            product = product.bfloat16().float()
        elif self.mode == ALIBI_FP16:
            product = product.half().float()
        return product * self.scale
