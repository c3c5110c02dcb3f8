"""The INT8 row GEMV on the matrix units (engine/quant/quant_int8_gemv.py) on a real GPU: every config, bf16 and
fp16, with and without residual, N not a multiple of a program's rows, equals the reference dequantizer + fp32
matmul (outputs poisoned first: every element written); its RMSNorm prologue equals the separate kernel + the same
GEMV within one rounding of x and a float32 reference; a row's output is bit-identical alone, among other rows
and on a repeat, and a CUDA graph replays it on new inputs; bad calls are refused. Skipped without CUDA."""

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
    from corolla.engine.quant.quant_weights import quantize_int8

    gen = torch.Generator(device=DEV).manual_seed(seed)
    return quantize_int8((torch.randn(n, k, device=DEV, generator=gen) * 0.03).to(dtype))


@pytest.mark.parametrize("dtype", [BF16, torch.float16])
@pytest.mark.parametrize("shape", [(203, 1152), (96, 4608)])
def test_row_mma_matches_reference(dtype, shape) -> None:
    from corolla.engine.quant.quant_int8_gemv import INT8_MMA_CONFIGS, int8_row_mma

    n, k = shape
    weight = _weight(n, k, seed=n + k, dtype=dtype)
    dense = weight.dequantize().float()  # [N, K]
    for m in (1, 3):
        x = torch.randn(m, k, device=DEV, dtype=dtype)
        res = torch.randn(m, n, device=DEV, dtype=dtype)
        expected = x.float() @ dense.t()  # [M, N]
        for config in INT8_MMA_CONFIGS:
            out = torch.full((m, n), float("nan"), device=DEV, dtype=dtype)
            out.copy_(int8_row_mma(x, weight, None, config))
            assert torch.isfinite(out).all(), (m, config)
            err = float((out.float() - expected).norm() / expected.norm())
            assert err < 1e-2, (m, config, err)
            with_res = int8_row_mma(x, weight, res, config)
            err = float((with_res.float() - expected - res.float()).norm() / expected.norm())
            assert err < 1.5e-2, (m, config, err)


@pytest.mark.parametrize("dtype", [BF16, torch.float16])
def test_row_mma_rmsnorm_prologue_matches_the_separate_kernel(dtype) -> None:
    from corolla.engine.kernels import triton_kernels
    from corolla.engine.kernels.quant_splits import PROLOGUES
    from corolla.engine.quant.quant_int8_gemv import INT8_MMA_CONFIGS, int8_row_mma

    n, k, eps, m = 203, 1152, 1e-5, 5
    weight = _weight(n, k, seed=11, dtype=dtype)
    gen = torch.Generator(device=DEV).manual_seed(12)
    x = (torch.randn(m, k, device=DEV, generator=gen) * 3).to(dtype)
    gain = (torch.rand(k, device=DEV, generator=gen) + 0.5).to(dtype)
    res = torch.randn(m, n, device=DEV, generator=gen).to(dtype)
    pre = triton_kernels.rms_norm(x, gain, eps)
    xf = x.float()
    ref_x = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(dtype) * gain  # as the reference layer
    dense = weight.dequantize().float()  # [N, K]
    expected = ref_x.float() @ dense.t() + res.float()  # [M, N]
    scale = pre.float().abs() @ dense.abs().t()  # [M, N] sum_k |x_k w_k|
    code = PROLOGUES["rmsnorm"]
    for config in INT8_MMA_CONFIGS:
        fused = int8_row_mma(x, weight, res, config, code, gain, eps)
        unfused = int8_row_mma(pre, weight, res, config)
        # an x value one rounding of its dtype away from the separate kernel's at most (1/rms summed in another
        # order; on an H200 the bits were equal at Llama-3-8B's shapes, decision 0063)
        bound = 2.0**-7 * (scale + unfused.float().abs()) + 1e-3
        assert ((fused.float() - unfused.float()).abs() <= bound).all(), config
        err = float((fused.float() - expected).norm() / expected.norm())
        assert err < 1e-2, (config, err)
        assert torch.equal(int8_row_mma(x, weight, res, config, code, gain, eps), fused), config
        for r in (0, m - 1):
            alone = int8_row_mma(x[r : r + 1].clone(), weight, res[r : r + 1].clone(), config, code, gain, eps)
            assert torch.equal(alone[0], fused[r]), (config, r)


def test_rows_are_batch_invariant_deterministic_and_replayed_by_graphs() -> None:
    from corolla.engine.quant.quant_int8_gemv import INT8_MMA_CONFIGS, int8_row_mma

    weight = _weight(520, 14336, seed=7)
    rows = torch.randn(5, 14336, device=DEV, dtype=BF16)
    res = torch.randn(5, 520, device=DEV, dtype=BF16)
    for config in INT8_MMA_CONFIGS:
        merged = int8_row_mma(rows, weight, res, config)
        assert torch.equal(int8_row_mma(rows, weight, res, config), merged), config
        for r in (0, 4):
            alone = int8_row_mma(rows[r : r + 1].contiguous(), weight, res[r : r + 1].contiguous(), config)
            assert torch.equal(alone[0], merged[r]), (config, r)
    config = INT8_MMA_CONFIGS[-1]
    x = torch.zeros(1, 14336, device=DEV, dtype=BF16)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        int8_row_mma(x, weight, None, config)  # compiled before the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        out = int8_row_mma(x, weight, None, config)
    for r in (1, 3):
        x.copy_(rows[r : r + 1])
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, int8_row_mma(rows[r : r + 1].contiguous(), weight, None, config)), r


def test_row_mma_refuses_bad_calls() -> None:
    from corolla.engine.quant.quant_int8_gemv import INT8_MMA_CONFIGS, int8_row_mma
    from corolla.engine.quant.quant_weights import quantize_int8

    config = INT8_MMA_CONFIGS[0]
    weight = _weight(64, 256, seed=1)
    x = torch.randn(1, 256, device=DEV, dtype=BF16)
    with pytest.raises(ValueError, match="rows"):
        int8_row_mma(x.half(), weight, None, config)
    with pytest.raises(ValueError, match="rows"):
        int8_row_mma(torch.randn(1, 128, device=DEV, dtype=BF16), weight, None, config)
    with pytest.raises(ValueError, match="residual"):
        int8_row_mma(x, weight, torch.randn(2, 64, device=DEV, dtype=BF16), config)
    with pytest.raises(ValueError, match="config"):
        int8_row_mma(x, weight, None, (0, 8, 2, 0, 0))
    not_64 = quantize_int8(torch.randn(64, 208, device=DEV, dtype=BF16))
    with pytest.raises(ValueError, match="K % 64"):
        int8_row_mma(torch.randn(1, 208, device=DEV, dtype=BF16), not_64, None, config)
    with pytest.raises(ValueError, match="gain"):
        int8_row_mma(x, weight, None, config, 1)  # RMSNorm without its gain
    with pytest.raises(ValueError, match="gain must be"):
        int8_row_mma(x, weight, None, config, 1, torch.ones(256, device=DEV), 1e-5)
    with pytest.raises(ValueError, match="runs no prologue 2"):  # SiLU gating: none here (decision 0063)
        int8_row_mma(x, weight, None, config, 2)
    fp32 = quantize_int8(torch.randn(64, 256, device=DEV))
    with pytest.raises(ValueError, match="bf16/fp16"):
        int8_row_mma(x.float(), fp32, None, config)
