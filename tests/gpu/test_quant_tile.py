"""The NF4 dequantize-tile GEMM (engine/quant_tile.py) on a real GPU: every config, with and without residual and
split K, equals the reference dequantizer + fp32 matmul on fresh random weights and inputs (outputs poisoned
first), rows are bit-identical whether their step carries 1, 2 or 4 16-row tiles per program, and bad calls are
refused. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

DEV = torch.device("cuda")
BF16 = torch.bfloat16


def _weight(n: int, k: int, seed: int, dtype: torch.dtype = BF16):
    from corolla.engine.quant import quantize_nf4

    gen = torch.Generator(device=DEV).manual_seed(seed)
    return quantize_nf4((torch.randn(n, k, device=DEV, generator=gen) * 0.03).to(dtype))


@pytest.mark.parametrize("dtype", [BF16, torch.float16])
@pytest.mark.parametrize("shape", [(200, 1088), (384, 4160)])
def test_tile_gemm_matches_reference(dtype, shape) -> None:
    from corolla.engine import quant_tile

    n, k = shape
    weight = _weight(n, k, seed=n + k, dtype=dtype)
    dense = weight.dequantize().float()  # [N, K]
    for m in (9, 16, 33, 64):
        x = torch.randn(m, k, device=DEV, dtype=dtype)
        res = torch.randn(m, n, device=DEV, dtype=dtype)
        expected = x.float() @ dense.t()
        for config in quant_tile.NF4_TILE_CONFIGS:
            out = torch.full((m, n), float("nan"), device=DEV, dtype=dtype)
            out.copy_(quant_tile.nf4_tile_matmul(x, weight, None, config))
            assert torch.isfinite(out).all(), (m, config)
            err = float((out.float() - expected).norm() / expected.norm())
            assert err < 1e-2, (m, config, err)
            with_res = quant_tile.nf4_tile_matmul(x, weight, res, config)
            err = float((with_res.float() - expected - res.float()).norm() / expected.norm())
            assert err < 1.5e-2, (m, config, err)


def test_tile_rows_are_batch_invariant() -> None:
    from corolla.engine import quant_tile

    weight = _weight(512, 2048, seed=5)
    rows = torch.randn(64, 2048, device=DEV, dtype=BF16)
    for config in quant_tile.NF4_TILE_CONFIGS:
        merged = quant_tile.nf4_tile_matmul(rows, weight, None, config)  # 4 tiles per program
        for m, r in ((9, 4), (20, 17), (40, 39), (1, 0)):
            part = quant_tile.nf4_tile_matmul(rows[:m].contiguous(), weight, None, config)  # 1, 2, 4 tiles
            assert torch.equal(part[r], merged[r]), (config, m, r)


def test_tile_refuses_bad_calls() -> None:
    from corolla.engine import quant_tile

    weight = _weight(64, 256, seed=1)
    config = quant_tile.NF4_TILE_CONFIGS[0]
    with pytest.raises(ValueError, match="rows"):
        quant_tile.nf4_tile_matmul(torch.randn(20, 128, device=DEV, dtype=BF16), weight, None, config)
    with pytest.raises(ValueError, match="residual"):
        quant_tile.nf4_tile_matmul(
            torch.randn(20, 256, device=DEV, dtype=BF16), weight, torch.randn(20, 32, device=DEV, dtype=BF16), config
        )
    with pytest.raises(ValueError, match="config"):
        quant_tile.nf4_tile_matmul(torch.randn(20, 256, device=DEV, dtype=BF16), weight, None, (16, 96, 1, 4, 3))
