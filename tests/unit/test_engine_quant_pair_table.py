"""The NF4 pair table (engine/quant/quant_pair_table.py) on CPU: every byte's entry holds both of its codes' fp16 levels in
the halves x's fp16x2 words pair with (the element order of bitsandbytes' bytes); the refusals. The table is read on a
GPU by the tile GEMV (tests/gpu/test_quant_tile_gemv.py)."""

from __future__ import annotations

import pytest
import torch

from benchmarks.common.quantize import NF4_LEVELS
from corolla.engine.quant import quant_pair_table


@pytest.mark.parametrize("table", ["nf4", "random"])
def test_entries_pair_every_value_with_its_element(table: str) -> None:
    code = torch.tensor(NF4_LEVELS) if table == "nf4" else torch.randn(16, generator=torch.Generator().manual_seed(3))
    pairs = quant_pair_table.pair_words16(code)
    levels = code.to(torch.float16)
    for b in range(256):  # low half: the high nibble's level (the even element); high half: the low nibble's
        word = int(pairs[b]) & 0xFFFFFFFF
        halves = torch.tensor([word & 0xFFFF, word >> 16], dtype=torch.int32).to(torch.int16).view(torch.float16)
        assert torch.equal(halves, torch.stack((levels[b >> 4], levels[b & 15]))), b


def test_refusals() -> None:
    with pytest.raises(ValueError, match="16 levels"):
        quant_pair_table.pair_words16(torch.zeros(8))
    with pytest.raises(ValueError, match="fp16 range"):
        quant_pair_table.pair_words16(torch.full((16,), 1e6))
