"""corolla's own NF4 and INT8 quantizers, for benchmarks and tests that need quantized weights without bitsandbytes
(here, not in tests/helpers: a benchmark imports no test code): the engine's layouts (`engine.quant.quant_weights`:
bitsandbytes' NF4 bytes with nested absmaxes; LLM.int8's row-wise absmax codes), filled by nearest-level rounding.
The server quantizes through bitsandbytes."""

from __future__ import annotations

import torch

from corolla.engine.quant.quant_weights import (
    NESTED_BLOCK_ABSMAXES,
    NF4_BLOCK_VALUES,
    Int8Weight,
    NF4Weight,
)
from corolla.models.prequantized import NF4_LEVELS


def uniform_nested_code(device: torch.device | str = "cpu") -> torch.Tensor:
    """A 256-entry signed code table for the absmaxes: any table is valid in the format (it travels with the
    weight); bitsandbytes uses its dynamic map, `quantize_nf4` defaults to this uniform one."""
    return torch.linspace(-1.0, 1.0, 256, device=device)


def _nearest(values: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    # index (uint8) of the nearest entry of an ascending `table` for every value
    if bool((table[1:] < table[:-1]).any()):
        raise ValueError("code tables must be ascending")
    midpoints = (table[1:] + table[:-1]) / 2
    return torch.bucketize(values, midpoints).to(torch.uint8)


@torch.no_grad()
def quantize_nf4(
    weight: torch.Tensor, *, nested_code: torch.Tensor | None = None, dtype: torch.dtype | None = None
) -> NF4Weight:
    """weight [N, K] (K a multiple of 64) -> its NF4 layout: each value to the nearest level of its block's
    absmax-normalized range; the absmaxes minus their mean to the nearest entry of `nested_code` within blocks
    of 256."""
    n, k = weight.shape
    if k % NF4_BLOCK_VALUES:
        raise ValueError(f"NF4 rows must be a multiple of {NF4_BLOCK_VALUES} values, got {k}")
    dev = weight.device
    w = weight.float().reshape(-1, NF4_BLOCK_VALUES)  # [blocks, 64]
    absmax = w.abs().amax(dim=1)  # [blocks]
    levels = torch.tensor(NF4_LEVELS, device=dev)
    normed = w / absmax.clamp_min(1e-12)[:, None]
    idx = _nearest(normed, levels).reshape(n, k)  # [N, K] uint8
    packed = (idx[:, 0::2] << 4) | idx[:, 1::2]  # [N, K/2]
    table = (nested_code if nested_code is not None else uniform_nested_code(dev)).float().to(dev)
    offset = float(absmax.mean())
    centered = absmax - offset
    pad = -centered.numel() % NESTED_BLOCK_ABSMAXES
    groups = torch.nn.functional.pad(centered, (0, pad)).reshape(-1, NESTED_BLOCK_ABSMAXES)  # [nested, 256]
    nested_absmax = groups.abs().amax(dim=1).clamp_min(1e-12)  # [nested]
    scaled = (groups / nested_absmax[:, None]).reshape(-1)[: centered.numel()]
    codes = _nearest(scaled, table)
    return NF4Weight(
        packed=packed.contiguous(),
        absmax_codes=codes,
        nested_absmax=nested_absmax,
        nested_code=table,
        nested_offset=offset,
        code=levels,
        dtype=dtype or weight.dtype,
    )


@torch.no_grad()
def quantize_int8(weight: torch.Tensor, *, dtype: torch.dtype | None = None) -> Int8Weight:
    """weight [N, K] -> row-wise absmax int8 codes (LLM.int8's weight format)."""
    absmax = weight.float().abs().amax(dim=1).clamp_min(1e-12)  # [N]
    codes = torch.round(weight.float() * (127.0 / absmax[:, None])).clamp(-127, 127).to(torch.int8)
    return Int8Weight(codes=codes, row_absmax=absmax, dtype=dtype or weight.dtype)
