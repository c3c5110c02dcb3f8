"""Triton kernels of the routed experts (`engine.moe.routed_experts.experts_forward` on CUDA): the token->expert assignments are
sorted by expert on the device, then one program per (expert, block of output columns) walks that expert's
assignments in tiles of 16 rows, so each chosen expert's weights are read once per step and unchosen experts' not
at all. Expert tensors are found through an int64 address table (read in place, no gather). Two kernels: gate_up
with the SiLU gate in its epilogue -> act [A, I]; down with the routing weight in its epilogue -> [A, H] fp32,
summed over the k choices of each token by torch (deterministic, no atomics). No host sync: CUDA-graph safe.
Importing fails without Triton."""

from __future__ import annotations

from typing import Protocol

import torch
import triton
import triton.language as tl


class ExpertTable(Protocol):
    """What the kernels read of one layer's experts (`moe.ExpertWeights`): their sizes, the int64 [E] address tables
    of every expert's gate_up [2I, H] and down [H, I] tensors, and 0..E [E + 1] for segmenting sorted ids."""

    @property
    def intermediate_size(self) -> int: ...
    @property
    def num_experts(self) -> int: ...
    @property
    def gate_up_ptrs(self) -> torch.Tensor: ...
    @property
    def down_ptrs(self) -> torch.Tensor: ...
    @property
    def boundaries(self) -> torch.Tensor: ...


BLOCK_M = 16  # assignment rows per tile (tl.dot's minimum)
# (BLOCK_N, BLOCK_K, num_warps, num_stages); the first is the default, `moe.tune_experts` times them all
EXPERT_CONFIGS: tuple[tuple[int, int, int, int], ...] = (
    (32, 128, 4, 4),
    (16, 256, 4, 4),
    (64, 128, 4, 3),
    (32, 256, 4, 3),
    (64, 64, 4, 4),
    (128, 64, 8, 3),
)


@triton.jit
def _gate_up_kernel(
    x_ptr,  # [N, H] rows of the tokens
    order_ptr,  # [A] int64: assignment index (token * TOP_K + choice) in expert-sorted order
    offsets_ptr,  # [E + 1] int64: expert e's assignments are order[offsets[e]:offsets[e + 1]]
    ptrs_ptr,  # [E] int64: address of expert e's gate_up [2I, H]
    act_ptr,  # [A, I] out, rows in sorted order
    H: tl.constexpr,
    INTER: tl.constexpr,
    stride_x,
    TOP_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    e = tl.program_id(0)
    nb = tl.program_id(1)
    start = tl.load(offsets_ptr + e)
    end = tl.load(offsets_ptr + e + 1)
    dtype = x_ptr.dtype.element_ty
    w_ptr = tl.multiple_of(tl.load(ptrs_ptr + e).to(tl.pointer_type(dtype)), 16)  # 16-byte aligned (ExpertWeights)
    rn = nb * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN] output columns (gate rows; up rows at + INTER)
    mask_n = rn < INTER
    rk0 = tl.arange(0, BLOCK_K)
    m0 = start
    while m0 < end:  # a while loop: the bounds are loaded values
        rm = m0 + tl.arange(0, BLOCK_M)  # [BM] sorted assignment rows
        mask_m = rm < end
        token = tl.load(order_ptr + rm, mask=mask_m, other=0) // TOP_K  # [BM]
        acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, H, BLOCK_K):
            rk = k0 + rk0
            mask_k = rk < H
            xt = tl.load(
                x_ptr + token[:, None] * stride_x + rk[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0
            )  # [BM, BK]
            w_mask = mask_k[:, None] & mask_n[None, :]
            wg = tl.load(w_ptr + rn[None, :].to(tl.int64) * H + rk[:, None], mask=w_mask, other=0.0)  # [BK, BN]
            wu = tl.load(w_ptr + (rn[None, :] + INTER).to(tl.int64) * H + rk[:, None], mask=w_mask, other=0.0)
            acc_g = tl.dot(xt, wg, acc_g)
            acc_u = tl.dot(xt, wu, acc_u)
        g = acc_g.to(dtype).to(tl.float32)  # the projection's output in the weights' dtype, as the reference
        u = acc_u.to(dtype).to(tl.float32)
        s = (g * tl.sigmoid(g)).to(dtype).to(tl.float32)  # silu, rounded as F.silu's output
        act = (s * u).to(dtype)  # [BM, BN]
        tl.store(act_ptr + rm[:, None].to(tl.int64) * INTER + rn[None, :], act, mask=mask_m[:, None] & mask_n[None, :])
        m0 += BLOCK_M


@triton.jit
def _down_kernel(
    act_ptr,  # [A, I] rows in sorted order
    order_ptr,  # [A] int64
    offsets_ptr,  # [E + 1] int64
    ptrs_ptr,  # [E] int64: address of expert e's down [H, I]
    weights_ptr,  # [A] fp32 routing weight of each assignment (unsorted)
    out_ptr,  # [A, H] fp32 out, rows by assignment index (unsorted)
    H: tl.constexpr,
    INTER: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    e = tl.program_id(0)
    nb = tl.program_id(1)
    start = tl.load(offsets_ptr + e)
    end = tl.load(offsets_ptr + e + 1)
    dtype = act_ptr.dtype.element_ty
    w_ptr = tl.multiple_of(tl.load(ptrs_ptr + e).to(tl.pointer_type(dtype)), 16)  # 16-byte aligned (ExpertWeights)
    rn = nb * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN] hidden columns
    mask_n = rn < H
    rk0 = tl.arange(0, BLOCK_K)
    m0 = start
    while m0 < end:  # a while loop: the bounds are loaded values
        rm = m0 + tl.arange(0, BLOCK_M)
        mask_m = rm < end
        assignment = tl.load(order_ptr + rm, mask=mask_m, other=0)  # [BM]
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, INTER, BLOCK_K):
            rk = k0 + rk0
            mask_k = rk < INTER
            at = tl.load(
                act_ptr + rm[:, None].to(tl.int64) * INTER + rk[None, :],
                mask=mask_m[:, None] & mask_k[None, :],
                other=0.0,
            )  # [BM, BK]
            wd = tl.load(
                w_ptr + rn[None, :].to(tl.int64) * INTER + rk[:, None],
                mask=mask_k[:, None] & mask_n[None, :],
                other=0.0,
            )  # [BK, BN]
            acc = tl.dot(at, wd, acc)
        scale = tl.load(weights_ptr + assignment, mask=mask_m, other=0.0)  # [BM] fp32
        y = acc.to(dtype).to(tl.float32) * scale[:, None]  # expert output rounded, then weighted (as the reference)
        tl.store(out_ptr + assignment[:, None] * H + rn[None, :], y, mask=mask_m[:, None] & mask_n[None, :])
        m0 += BLOCK_M


def grouped_experts(
    x: torch.Tensor,
    expert_ids: torch.Tensor,
    expert_weights: torch.Tensor,
    experts: ExpertTable,
    config: tuple[int, ...],
) -> torch.Tensor:
    """`moe.experts_forward` on CUDA (inputs already checked there): x [N, H], expert_ids [N, k], expert_weights
    [N, k] fp32 -> [N, H] in x's dtype."""
    n, h = x.shape
    k = expert_ids.shape[1]
    inter = experts.intermediate_size
    num_experts = experts.num_experts
    block_n, block_k, warps, stages = config
    if x.stride(1) != 1:
        x = x.contiguous()
    flat = expert_ids.reshape(-1).long()  # [A = N k]
    sorted_ids, order = torch.sort(flat, stable=True)  # [A] each
    offsets = torch.searchsorted(sorted_ids, experts.boundaries)  # [E + 1]; ids outside [0, E) fall outside
    act = torch.empty((n * k, inter), dtype=x.dtype, device=x.device)  # [A, I]
    out = torch.zeros((n * k, h), dtype=torch.float32, device=x.device)  # [A, H]
    _gate_up_kernel[(num_experts, triton.cdiv(inter, block_n))](
        x, order, offsets, experts.gate_up_ptrs, act, h, inter, x.stride(0),
        TOP_K=k, BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    _down_kernel[(num_experts, triton.cdiv(h, block_n))](
        act, order, offsets, experts.down_ptrs, expert_weights.reshape(-1).contiguous(), out, h, inter,
        BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out.view(n, k, h).sum(dim=1).to(x.dtype)  # [N, H]
