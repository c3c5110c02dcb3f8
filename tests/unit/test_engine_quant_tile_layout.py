"""The NF4 tile GEMV's reading of bitsandbytes' bytes (engine/quant/quant_tile_gemv.py) on CPU: the kernel's data
movement (which lane loads which bytes of rows g and g + 8, which B lanes hold which x, each column's block and
absmax, each warp's range of units and the row's slots added in warp order) emulated through the PTX fragment
layout of `mma.m16n8k16` gives x @ the weight for ragged shapes (rows padded to a tile, blocks short of a unit, more
warps than units), bf16 and fp16. The kernel itself runs in tests/gpu/test_quant_tile_gemv.py."""

from __future__ import annotations

import pytest
import torch
from tests.helpers.kernel_emulation import emulate_tile_gemv, program_row_tiles, warp_units

from benchmarks.common.quantize import quantize_nf4


def _fp16_level_reference(weight) -> torch.Tensor:
    n, k = weight.shape
    codes = torch.stack(((weight.packed >> 4).long(), (weight.packed & 15).long()), dim=-1).reshape(n, k)
    return (weight.code.half().double()[codes].reshape(-1, 64) * weight.block_absmax().double()[:, None]).reshape(n, k)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    ("shape", "warps", "programs"),
    # a partial tile and unit; whole ones; idle warps; more warps than units, empty ranges among the others
    [((40, 384), 3, 2), ((32, 512), 4, 1), ((16, 192), 8, 1), ((40, 1216), 32, 2)],
)
def test_emulated_kernel_reads_the_weight(dtype, shape, warps, programs) -> None:
    n, k = shape
    gen = torch.Generator().manual_seed(n + k)
    weight = quantize_nf4((torch.randn(n, k, generator=gen) * 0.05).to(dtype))
    x = torch.randn(2, k, generator=gen).to(dtype)
    got = emulate_tile_gemv(x, weight, warps, programs).double()
    xs = (x.float() * 2.0**-8).half().double() * 2.0**8 if dtype == torch.bfloat16 else x.double()
    want = xs @ _fp16_level_reference(weight).t()
    assert float((got - want).norm() / want.norm()) < 1e-2  # one rounding to the output dtype


@pytest.mark.parametrize(("warps", "programs"), [(3, 2), (8, 3), (32, 2)])
def test_emulated_gated_form_pairs_each_gate_row_with_its_up_row(warps, programs) -> None:
    n, k = 96, 384  # [gate | up] of 48 rows: 3 row tiles a half, split over 2 or 3 programs
    gen = torch.Generator().manual_seed(7)
    weight = quantize_nf4((torch.randn(n, k, generator=gen) * 0.05).to(torch.bfloat16))
    x = torch.randn(2, k, generator=gen).to(torch.bfloat16)
    got = emulate_tile_gemv(x, weight, warps, programs, gated=True).double()
    xs = (x.float() * 2.0**-8).half().double() * 2.0**8
    gate_up = xs @ _fp16_level_reference(weight).t()
    want = torch.nn.functional.silu(gate_up[:, : n // 2]) * gate_up[:, n // 2 :]
    assert got.shape == (2, n // 2)
    assert float((got - want).norm() / want.norm()) < 1e-2


def test_work_ranges_cover_every_unit_once() -> None:
    for row_tiles, programs in ((1792, 132), (3, 5), (256, 264)):
        firsts = [program_row_tiles(row_tiles, programs, p) for p in range(programs)]
        assert firsts[0][0] == 0 and firsts[-1][1] == row_tiles
        assert all(a[1] == b[0] for a, b in zip(firsts, firsts[1:], strict=False))
    for units, warps in ((224, 32), (3, 8), (48, 16)):
        ranges = [warp_units(units, warps, w) for w in range(warps)]
        assert sum(end - first for first, end in ranges) == units
        assert max(end - first for first, end in ranges) - min(end - first for first, end in ranges) <= 1
