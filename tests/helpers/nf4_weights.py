"""NF4 weights for the GPU kernel tests: every packed code drawn at random (so one-hot rows read back every level), on
NF4's table or a random 16-level one, and the reference the kernels must reproduce: each level rounded to fp16 (as
their pair tables hold it) times its block's absmax."""

from __future__ import annotations

import torch

from benchmarks.common.quantize import quantize_nf4
from corolla.engine.quant.quant_weights import NF4Weight

CUDA = torch.device("cuda")


def random_code_weight(
    n: int, k: int, seed: int, dtype: torch.dtype, random_table: bool = False, device: torch.device = CUDA
) -> NF4Weight:
    """[N, K] NF4 weight with random codes; `random_table`: magnitudes 0.5 to 2.5 (fp16 keeps them normal after x's
    2^-8 scaling) with random signs instead of NF4's levels."""
    gen = torch.Generator(device=device).manual_seed(seed)
    w = quantize_nf4((torch.randn(n, k, device=device, generator=gen) * 0.03).to(dtype))
    packed = torch.randint(0, 256, w.packed.shape, device=device, dtype=torch.uint8, generator=gen)  # every code
    signs = torch.randint(0, 2, (16,), device=device, generator=gen) * 2 - 1
    code = (torch.rand(16, device=device, generator=gen) + 0.25) * 2 * signs if random_table else w.code
    return NF4Weight(packed, w.absmax_codes, w.nested_absmax, w.nested_code, w.nested_offset, code, dtype)


def fp16_level_reference(weight: NF4Weight) -> torch.Tensor:
    """[N, K] fp32: the level rounded to fp16 times the block absmax."""
    n, k = weight.shape
    codes = torch.stack(((weight.packed >> 4).long(), (weight.packed & 15).long()), dim=-1).reshape(n, k)
    return (weight.code.half().float()[codes].reshape(-1, 64) * weight.block_absmax()[:, None]).reshape(n, k)
