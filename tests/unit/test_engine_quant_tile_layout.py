"""The NF4 tile GEMV's repacked layout (engine/quant_tile_gemv.py) on CPU: read back through the kernel's mma fragment
mapping (which lane's bytes meet which x values and which absmax), it gives x @ the weight for ragged shapes (rows
padded to a tile, blocks padded to a group of 4), bf16 and fp16; every code byte lands in exactly one place. The
kernel itself runs in tests/gpu/test_quant_tile_gemv.py."""

from __future__ import annotations

import pytest
import torch

from corolla.engine.quant.quant_tile_gemv import emulate, tile_layout
from corolla.engine.quant.quant_weights import quantize_nf4


def _fp16_level_reference(weight) -> torch.Tensor:
    n, k = weight.shape
    codes = torch.stack(((weight.packed >> 4).long(), (weight.packed & 15).long()), dim=-1).reshape(n, k)
    return (weight.code.half().double()[codes].reshape(-1, 64) * weight.block_absmax().double()[:, None]).reshape(n, k)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(40, 384), (32, 512)])  # padded rows and blocks; whole tiles and groups
def test_emulated_kernel_reads_the_weight(dtype, shape) -> None:
    n, k = shape
    gen = torch.Generator().manual_seed(n + k)
    weight = quantize_nf4((torch.randn(n, k, generator=gen) * 0.05).to(dtype))
    x = torch.randn(2, k, generator=gen).to(dtype)
    tiles = tile_layout(weight)
    assert tiles.tiles.shape == (-(-n // 16), -(-k // 256) * 4, 32, 16)
    got = emulate(x, weight, tiles).double()
    xs = (x.float() * 2.0**-8).half().double() * 2.0**8 if dtype == torch.bfloat16 else x.double()
    want = xs @ _fp16_level_reference(weight).t()
    assert float((got - want).norm() / want.norm()) < 1e-2  # one rounding to the output dtype


def test_every_code_byte_lands_once() -> None:
    n, k = 32, 512
    weight = quantize_nf4(torch.randn(n, k))
    weight.packed.copy_(torch.arange(n * k // 2).reshape(n, k // 2) % 251)  # a position-dependent byte pattern
    tiles = tile_layout(weight)
    assert sorted(tiles.tiles.flatten().tolist()) == sorted(weight.packed.flatten().tolist())
    # lane 4 g + t, word s, byte 1: row g + 8 of tile 0, block 0, byte pair 8 t + 2 s
    for g, t, s in ((0, 0, 0), (3, 2, 1), (7, 3, 3)):
        assert int(tiles.tiles[0, 0, 4 * g + t, 4 * s + 1]) == int(weight.packed[g + 8, 8 * t + 2 * s])
        assert int(tiles.tiles[1, 1, 4 * g + t, 4 * s + 2]) == int(weight.packed[16 + g, 32 + 8 * t + 2 * s + 1])
    codes = weight.absmax_codes.reshape(n, k // 64)
    assert int(tiles.codes[1, 0, 5, 3, 1]) == int(codes[16 + 8 + 5, 3])  # group 0, lane 4 * 5 + 3, row g + 8
    assert int(tiles.codes[0, 1, 2, 1, 0]) == int(codes[2, 5])  # group 1, lane 4 * 2 + 1, row g, block 4 + 1
