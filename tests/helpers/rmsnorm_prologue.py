"""The RMSNorm prologue check the row GEMVs' GPU tests share (the NF4 tile GEMV, the INT8 row GEMV: both stage x
through nvrtc_kernels' stage_x): fused against the separate norm kernel + the same GEMV, against a float32 reference,
repeated, and a row alone against the same row among others."""

from __future__ import annotations

from collections.abc import Callable

import torch

CUDA = torch.device("cuda")


def check_rmsnorm_prologue(
    run: Callable[..., torch.Tensor], dense: torch.Tensor, configs, dtype: torch.dtype, rows: int = 5
) -> None:
    """`run(x, res, config)`: the GEMV of x [M, K] with residual res [M, N]; `run(x, res, config, gain, eps)`: the
    same with its RMSNorm prologue (gain [K]). `dense` [N, K] fp32: the weight as the GEMV dequantizes it. For every
    config: each fused output within one x rounding of the norm kernel + the GEMV, within 1e-2 of the float32
    reference layer, the same bits on a repeat, and rows 0 and M - 1 alone equal to themselves among the others."""
    from corolla.engine.kernels import triton_kernels

    n, k = dense.shape
    eps = 1e-5
    gen = torch.Generator(device=CUDA).manual_seed(12)
    x = (torch.randn(rows, k, device=CUDA, generator=gen) * 3).to(dtype)
    gain = (torch.rand(k, device=CUDA, generator=gen) + 0.5).to(dtype)
    res = torch.randn(rows, n, device=CUDA, generator=gen).to(dtype)
    pre = triton_kernels.rms_norm(x, gain, eps)
    xf = x.float()
    ref_x = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(dtype) * gain  # as the reference layer
    expected = ref_x.float() @ dense.t() + res.float()  # [M, N]
    scale = pre.float().abs() @ dense.abs().t()  # [M, N] sum_k |x_k w_k|
    for config in configs:
        fused = run(x, res, config, gain, eps)
        unfused = run(pre, res, config)
        # an x value one rounding of its dtype away from the separate kernel's at most (1/rms summed in another
        # order; on an H200 the bits were equal at Llama-3-8B's shapes, docs/decisions/0043, 0063)
        bound = 2.0**-7 * (scale + unfused.float().abs()) + 1e-3
        assert ((fused.float() - unfused.float()).abs() <= bound).all(), config
        err = float((fused.float() - expected).norm() / expected.norm())
        assert err < 1e-2, (config, err)
        assert torch.equal(run(x, res, config, gain, eps), fused), config
        for r in (0, rows - 1):  # a row alone: its bits among the others
            alone = run(x[r : r + 1].clone(), res[r : r + 1].clone(), config, gain, eps)
            assert torch.equal(alone[0], fused[r]), (config, r)
