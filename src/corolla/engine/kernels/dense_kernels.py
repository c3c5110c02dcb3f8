"""Triton kernel of the Falcon/BLOOM decode step between two projections: the residual add (of one projection's
output, or of two summed first: Falcon's parallel attention + MLP) and the next LayerNorm (with bias) in one
program per row, each row held in registers. It replaces torch's LayerNorm kernel (one block per row, ~8 us for a
4096-wide row on an H200) and the separate bias/residual kernels around cuBLAS. Importing fails without Triton;
`dense_ops` holds the torch references and the choice."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from corolla.engine.kernels.alibi_triton import round_bf16


@triton.jit
def _bf16_rounded(x, BF16: tl.constexpr):
    # fp32 -> rounded to bf16 (nearest, ties to even) on the bits when BF16, so that the cast after it is exact in
    # Triton's interpreter too (its bf16 cast truncates); other dtypes as they are
    if BF16:
        x = round_bf16(x)
    return x


@triton.jit
def _add_layer_norm_kernel(
    a_ptr,
    b_ptr,
    res_ptr,
    h_ptr,
    w_ptr,
    nb_ptr,
    out_ptr,
    stride_a,
    stride_b,
    stride_r,
    stride_h,
    stride_o,
    n_cols,
    eps,
    ADDS: tl.constexpr,
    NORM: tl.constexpr,
    BF16: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # ADDS 0: h = res (not written); 1: h = res + a; 2: h = res + (a + b), each sum rounded to the output dtype as
    # torch's elementwise adds do. NORM: out = LayerNorm(h) * w + nb with fp32 statistics of the rounded h.
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < n_cols
    dt = h_ptr.dtype.element_ty
    h = tl.load(res_ptr + row * stride_r + offs, mask=mask, other=0.0).to(tl.float32)  # [BLOCK]
    if ADDS >= 1:
        a = tl.load(a_ptr + row * stride_a + offs, mask=mask, other=0.0).to(tl.float32)
        if ADDS == 2:
            b = tl.load(b_ptr + row * stride_b + offs, mask=mask, other=0.0).to(tl.float32)
            a = _bf16_rounded(a + b, BF16).to(dt).to(tl.float32)
        h = _bf16_rounded(h + a, BF16).to(dt).to(tl.float32)
        tl.store(h_ptr + row * stride_h + offs, h.to(dt), mask=mask)
    if NORM:
        mean = tl.sum(h, axis=0) / n_cols
        diff = tl.where(mask, h - mean, 0.0)
        rstd = 1.0 / tl.sqrt(tl.sum(diff * diff, axis=0) / n_cols + eps)
        w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        nb = tl.load(nb_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        y = _bf16_rounded(diff * rstd * w + nb, BF16)
        tl.store(out_ptr + row * stride_o + offs, y.to(dt), mask=mask)


def _warps(block: int) -> int:
    return 4 if block <= 1024 else 8 if block <= 4096 else 16


def add_layer_norm(
    a: torch.Tensor | None,
    b: torch.Tensor | None,
    residual: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Same contract as `dense_ops.add_layer_norm_ref`: a, b, residual [N, H] (rows with a contiguous last dim),
    weight/bias [H] or None (no norm) -> (h [N, H], LayerNorm(h) [N, H] or None). With `a` None, h is `residual`."""
    n, cols = residual.shape
    adds = 0 if a is None else 1 if b is None else 2
    if adds == 0 and weight is None:
        raise ValueError("add_layer_norm needs an addend or a norm")
    norm = weight is not None
    if norm and bias is None:
        raise ValueError("The dense LayerNorm has a bias")
    h = residual if adds == 0 else torch.empty_like(residual)
    out = torch.empty_like(residual) if norm else h
    a_ = a if a is not None else residual
    b_ = b if b is not None else a_
    w_ = weight if weight is not None else residual
    nb_ = bias if bias is not None else w_
    for t in (a_, b_, residual):
        if t.shape != (n, cols) or t.stride(1) != 1 or t.dtype != residual.dtype:
            raise ValueError(
                f"add_layer_norm takes [N, H] rows of one dtype with a contiguous last dim, not {tuple(t.shape)} "
                f"{t.dtype}"
            )
    block = triton.next_power_of_2(cols)
    _add_layer_norm_kernel[(n,)](
        a_, b_, residual, h, w_, nb_, out,
        a_.stride(0), b_.stride(0), residual.stride(0), h.stride(0), out.stride(0), cols, eps,
        ADDS=adds, NORM=norm, BF16=residual.dtype == torch.bfloat16, BLOCK=block, num_warps=_warps(block),
    )  # fmt: skip
    return h, out if norm else None
