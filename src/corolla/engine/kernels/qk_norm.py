"""Per-head RMSNorm of the query and key heads inside a fused qkv projection (Qwen3's `q_norm`/`k_norm`, applied
before the rotary embedding): a PyTorch reference and a Triton kernel that normalizes in place (graph safe)."""

from __future__ import annotations

import torch

try:  # Triton ships with CUDA builds of PyTorch; CPU-only installs use the reference version.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the installation
    triton = None


def qk_norm_ref(
    qkv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, num_heads: int, num_kv_heads: int, eps: float
) -> torch.Tensor:
    """qkv [N, (nq + 2 nkv) D]; weights [D]. Returns a new [N, (nq + 2 nkv) D] with each q and k head normalized
    (statistics in float32, rounded before the weight, as transformers' RMSNorm)."""
    n = qkv.shape[0]
    d = q_weight.shape[0]
    heads = qkv.view(n, -1, d)  # [N, nq + 2 nkv, D]
    qk = heads[:, : num_heads + num_kv_heads].float()
    normed = (qk * torch.rsqrt(qk.pow(2).mean(-1, keepdim=True) + eps)).to(qkv.dtype)  # [N, nq + nkv, D]
    weight = torch.cat((q_weight.expand(num_heads, d), k_weight.expand(num_kv_heads, d)))  # [nq + nkv, D]
    out = torch.cat((normed * weight, heads[:, num_heads + num_kv_heads :]), dim=1)
    return out.reshape(n, -1)


if triton is not None:

    @triton.jit
    def _qk_norm_kernel(qkv_ptr, qw_ptr, kw_ptr, stride_row, num_heads, eps, D: tl.constexpr):
        # one program per (row, q-or-k head), in place
        row = tl.program_id(0)
        head = tl.program_id(1)
        offs = tl.arange(0, D)
        ptr = qkv_ptr + row * stride_row + head * D + offs
        x = tl.load(ptr).to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / D + eps)
        is_q = head < num_heads
        w = tl.where(is_q, tl.load(qw_ptr + offs), tl.load(kw_ptr + offs))
        tl.store(ptr, ((x * rstd).to(w.dtype) * w).to(qkv_ptr.dtype.element_ty))


def qk_norm_triton(
    qkv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, num_heads: int, num_kv_heads: int, eps: float
) -> torch.Tensor:
    """As `qk_norm_ref`, in place on `qkv` (rows contiguous, D a power of two); returns `qkv`."""
    n = qkv.shape[0]
    d = q_weight.shape[0]
    _qk_norm_kernel[(n, num_heads + num_kv_heads)](qkv, q_weight, k_weight, qkv.stride(0), num_heads, eps, D=d)
    return qkv
