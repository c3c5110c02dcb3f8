"""MXFP4 expert weights as OpenAI publishes gpt-oss (`*_blocks`: two 4-bit E2M1 values per byte, low nibble first,
32 values per block; `*_scales`: one power-of-two exponent per block, biased by 127), dequantized on load into the
stacked `[E, in, out]` layout our experts use. Checkpoint bytes are hostile: dtypes and shapes are checked first."""

from __future__ import annotations

import torch

FP4_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
BYTES_PER_BLOCK = 16  # 32 fp4 values
SCALE_BIAS = 127


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """blocks uint8 [E, rows, G, 16], scales uint8 [E, rows, G] -> [E, G * 32, rows] in `dtype` (a checkpoint's
    `[E, out, in / 2]` packing becomes our `[E, in, out]`)."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.ndim != 4 or blocks.shape[-1] != BYTES_PER_BLOCK or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise ValueError(
            f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} must be [E, rows, G, 16] and "
            f"[E, rows, G]"
        )
    E, rows, G, _ = blocks.shape
    lut = torch.tensor(FP4_E2M1_VALUES, dtype=torch.float32, device=blocks.device)  # [16]
    values = torch.empty(E, rows, G, 2 * BYTES_PER_BLOCK, dtype=torch.float32, device=blocks.device)
    values[..., 0::2] = lut[(blocks & 0x0F).long()]  # low nibble first
    values[..., 1::2] = lut[(blocks >> 4).long()]
    exponents = scales.to(torch.int32) - SCALE_BIAS  # [E, rows, G]
    values = torch.ldexp(values, exponents[..., None])  # [E, rows, G, 32]
    return values.reshape(E, rows, G * 2 * BYTES_PER_BLOCK).transpose(1, 2).to(dtype).contiguous()  # [E, in, rows]


def dequantize_expert_tensors(state_dict: dict[str, torch.Tensor], names: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """Replaces `<name>_blocks` + `<name>_scales` by the dequantized `<name>` for each name present (idempotent)."""
    result = dict(state_dict)
    for name in names:
        blocks, scales = result.get(f"{name}_blocks"), result.get(f"{name}_scales")
        if blocks is None and scales is None:
            continue
        if blocks is None or scales is None:
            raise ValueError(f"MXFP4 tensor {name!r} needs both {name}_blocks and {name}_scales")
        result[name] = dequantize_mxfp4(result.pop(f"{name}_blocks"), result.pop(f"{name}_scales"))
    return result
