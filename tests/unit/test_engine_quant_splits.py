"""The split-K arrival counters of the quantized weights on CPU (the kernels that use them, engine/kernels/quant_splits.py,
run in tests/gpu/test_quant_gemv.py): each weight gets enough counters for the most output tiles any split-K
kernel over it launches (GEMV tiles of >= 8 features x 2 row groups, tl.dot tiles of >= 16 features x 4 16-row
tiles), one persistent zeroed tensor per weight (a CUDA graph replays the same addresses), and a call with more
tiles than counters is refused with the limit in the message."""

from __future__ import annotations

import pytest
import torch

from benchmarks.common.quantize import quantize_int8, quantize_nf4
from corolla.engine.quant.quant_weights import (
    SPLIT_COUNTERS,
    counters_for_tiles,
    split_counter_slots,
)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@pytest.mark.parametrize("n_out", [1, 7, 64, 520, 4096, 6144, 14336, 28672, 65537, 152064])
def test_counters_cover_every_split_kernel_grid(n_out: int) -> None:
    slots = split_counter_slots(n_out)
    assert slots >= SPLIT_COUNTERS
    gemv_tiles = _cdiv(n_out, 8) * _cdiv(8, 4)  # narrowest GEMV tile (INT8 [8, K]), 8 rows at 4 per program
    dot_tiles = _cdiv(64, 16) * _cdiv(n_out, 16)  # narrowest tl.dot tile, 64 rows in 16-row tiles
    assert slots >= max(gemv_tiles, dot_tiles)
    assert slots <= max(SPLIT_COUNTERS, n_out // 2 + 4)  # not more than that: N / 2 ints per weight


def test_counter_slots_refuse_an_empty_weight() -> None:
    with pytest.raises(ValueError, match="at least one output feature"):
        split_counter_slots(0)


@pytest.mark.parametrize("kind", ["nf4", "int8"])
def test_each_weight_keeps_one_zeroed_counter_tensor(kind: str) -> None:
    dense = torch.randn(4160, 128) * 0.02
    weight = quantize_nf4(dense, dtype=torch.bfloat16) if kind == "nf4" else quantize_int8(dense)
    counters = weight.split_counters()
    assert counters.dtype == torch.int32 and counters.device == dense.device
    assert counters.numel() == split_counter_slots(4160) == 4 * _cdiv(4160, 8)
    assert int(counters.abs().sum()) == 0
    assert weight.split_counters() is counters  # the same memory on every call (graph replays)
    assert counters_for_tiles(weight, counters.numel()) is counters
    with pytest.raises(ValueError, match=f"{counters.numel() + 1} output tiles exceed the weight's {counters.numel()}"):
        counters_for_tiles(weight, counters.numel() + 1)
