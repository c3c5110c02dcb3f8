"""The NF4 pair table: one shared-memory load decodes one packed byte (two 4-bit codes) into both fp16 levels.

bitsandbytes' byte j of a packed word holds code 2j in its high nibble and code 2j + 1 in its low one, so the byte is
an index into a 256-entry table of fp16x2 words (`pair_words16`: level(b >> 4) in the low half, level(b & 15) in
the high half, the even element low as in x's fp16x2 words: already a matrix-unit operand register). The NF4 tile
GEMV (quant_tile_gemv) copies the table into shared memory once per program, 32 times over, one column per lane, so
a warp's 32 loads never conflict whatever the codes: a byte costs a byte permute (its address) and one shared load,
against the register lookup's 16 byte permutes per 8 values (quant_prmt, docs/decisions/0015, 0021, 0031).
Importing needs no GPU."""

from __future__ import annotations

import torch

ENTRIES = 256


def pair_words16(code: torch.Tensor) -> torch.Tensor:
    """[16] levels -> [256] int32 fp16x2 words: entry b holds fp16(level(b >> 4)) in its low half and
    fp16(level(b & 15)) in its high half (ValueError unless 16 finite levels fp16 holds)."""
    if code.numel() != 16:
        raise ValueError(f"the NF4 pair table takes 16 levels, got {code.numel()}")
    levels = code.detach().to("cpu", torch.float32)
    if not bool(torch.isfinite(levels).all()) or float(levels.abs().max()) > 65504.0:
        raise ValueError("NF4 levels must be finite and within fp16 range")
    bits = levels.to(torch.float16).view(torch.int16).to(torch.int64) & 0xFFFF  # [16]
    words = (bits[:, None] | (bits[None, :] << 16)).reshape(ENTRIES)  # [256]: row = high nibble = even element
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)
