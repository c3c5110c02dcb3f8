"""Triton kernels of the quantized routed experts (`engine.moe.routed_experts.experts_forward` on CUDA for
`moe_quant.QuantizedExpertWeights`): the grouped structure of `moe_kernels` (assignments sorted by expert on the
device; one program per (expert, block of output columns) walks that expert's assignments in 16-row tiles; unused
experts' bytes are never read) with the weight tiles decoded in registers from bitsandbytes' layouts, found through
the per-expert address tables:

- NF4: per 64-value block one gather per packed byte from the 256-entry pair table (both levels in the compute
  dtype), two depth-32 `tl.dot`s against x's even and odd columns, the block's absmax (8-bit code -> second-level
  code table * second-level absmax + offset) applied to the fp32 result. (At up to `moe_nf4_tile.TILE_MAX_TOKENS`
  tokens NF4 experts run the tile GEMV instead.)
- Int8: the codes converted to the compute dtype (exact: |code| <= 127), `tl.dot`, and each output column scaled
  by its row absmax / 127 in fp32 before rounding (as `quant_kernels` does for the dense Int8 projections).

Epilogues as in `moe_kernels`: gate_up rounds each projection and the SiLU to the compute dtype -> act [A, I];
down rounds the expert output, weights it by the routing weight in fp32 -> [A, H] fp32, summed over the k choices
of each token by torch (fixed order, no atomics). Batch invariance: a row's output is computed by the same
instructions whatever the other rows are. No host sync: CUDA-graph safe. Importing fails without Triton."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

if TYPE_CHECKING:
    from corolla.engine.moe.moe_quant import QuantizedExpertWeights

BLOCK_M = 16  # assignment rows per tile (tl.dot's minimum)
# (BLOCK_N, BLOCK_K, num_warps, num_stages, pair, down splits); BLOCK_K a multiple of 64 (NF4 absmax blocks). pair = 0
# (Int8): the codes converted and multiplied in one tl.dot; pair = 1 (NF4): the pair-table decode above (as
# `quant_kernels`' NF4 kernel; no dequantized tile, no layout change; why NF4 has no other: docs/decisions/0077).
# down splits > 1: the down projection's K (the intermediate size, 224 serial NF4 blocks per program at Mixtral's
# shape) is cut into that many ranges run by separate programs, their fp32 partial sums added in split order by torch
# (no atomics), then rounded and weighted. The pair decode with 4 and 8 down splits is not offered: the fastest in
# its one real-shape run (H200, 4 layers: 0.55 vs 0.90 ms a layer at one token), it disagreed with the dequantized
# reference there by 0.476 (relative), unexplained (Triton's interpreter agrees to 8e-4): check it on a GPU first.
# `moe.tune_experts` times every entry valid for the kind at warm-up.
QUANT_EXPERT_CONFIGS: tuple[tuple[int, int, int, int, int, int], ...] = (
    (32, 128, 4, 3, 0, 1),
    (64, 128, 4, 3, 0, 1),
    (32, 256, 4, 3, 0, 1),
    (16, 256, 4, 3, 0, 1),
    (64, 64, 4, 4, 0, 1),
    (128, 128, 8, 3, 0, 1),
    (32, 128, 4, 3, 1, 1),
    (64, 128, 4, 3, 1, 1),
    (128, 64, 8, 3, 1, 1),
    (64, 128, 4, 3, 0, 4),
)


def configs_for(kind: str) -> tuple[tuple[int, int, int, int, int, int], ...]:
    """The configs of "nf4" (the pair decode) or "int8" experts."""
    return tuple(c for c in QUANT_EXPERT_CONFIGS if bool(c[4]) == (kind == "nf4"))


@triton.jit
def _int8_tile(addr_ptr, e, rows, mask_rows, k0, K: tl.constexpr, BLOCK_K: tl.constexpr, like_ptr):
    # -> Int8 W_e[rows, k0 : k0 + BLOCK_K]^T as [BLOCK_K, BLOCK_N] codes in like_ptr's dtype (exact, unscaled).
    # addr_ptr: [4, E] int64 address table (codes first)
    q_ptr = tl.multiple_of(tl.load(addr_ptr + e).to(tl.pointer_type(tl.int8)), 16)
    rk = k0 + tl.arange(0, BLOCK_K)
    codes = tl.load(
        q_ptr + rows[None, :].to(tl.int64) * K + rk[:, None], mask=(rk < K)[:, None] & mask_rows[None, :], other=0
    )  # [BK, BN] int8
    return codes.to(like_ptr.dtype.element_ty)


@triton.jit
def _column_scales(addr_ptr, E, e, cols, mask):
    # Int8: [BN] fp32 scales (row absmax / 127) of the output columns `cols` of expert e
    return tl.load(tl.load(addr_ptr + E + e).to(tl.pointer_type(tl.float32)) + cols, mask=mask, other=0.0)


@triton.jit
def _nf4_pair_dot(acc, x_ptr, x_rows, mask_m, addr_ptr, E, e, pair_ptr, offset, rows, mask_rows, k0,
                  K: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
    # acc [BM, BN] += x[x_rows, k0 : k0 + BLOCK_K] @ W_e[rows, k0 : k0 + BLOCK_K]^T, NF4 decoded per 64-value block:
    # byte j of a block holds elements 2j (high nibble) and 2j + 1 (low nibble) -> x's even and odd columns
    q_ptr = tl.multiple_of(tl.load(addr_ptr + e).to(tl.pointer_type(tl.uint8)), 16)
    s_ptr = tl.load(addr_ptr + E + e).to(tl.pointer_type(tl.uint8))
    na_ptr = tl.load(addr_ptr + 2 * E + e).to(tl.pointer_type(tl.float32))
    nc_ptr = tl.load(addr_ptr + 3 * E + e).to(tl.pointer_type(tl.float32))
    dt = x_ptr.dtype.element_ty
    offs_t = tl.arange(0, 32)
    for b in tl.static_range(BLOCK_K // 64):
        blk = k0 // 64 + b
        valid = blk < K // 64
        bmask = mask_rows & valid  # [BN]
        byte = tl.load(
            q_ptr + rows[None, :].to(tl.int64) * (K // 2) + blk * 32 + offs_t[:, None], mask=bmask[None, :], other=0
        )  # [32, BN] uint8
        pair = tl.load(pair_ptr + byte.to(tl.int32))  # [32, BN] int32: (level(hi) bits << 16) | level(lo) bits
        c_hi = (pair >> 16).to(tl.int16).to(dt, bitcast=True)
        c_lo = (pair & 0xFFFF).to(tl.int16).to(dt, bitcast=True)
        gb = rows.to(tl.int64) * (K // 64) + blk  # [BN] absmax block of each output row
        aq = tl.load(s_ptr + gb, mask=bmask, other=0).to(tl.int32)
        absmax = tl.load(nc_ptr + aq) * tl.load(na_ptr + gb // 256, mask=bmask, other=0.0) + offset  # [BN] fp32
        cols = blk * 64 + 2 * offs_t  # [32] even columns
        xm = mask_m[:, None] & valid
        x_even = tl.load(x_ptr + x_rows[:, None] + cols[None, :], mask=xm, other=0.0)  # [BM, 32]
        x_odd = tl.load(x_ptr + x_rows[:, None] + cols[None, :] + 1, mask=xm, other=0.0)
        acc += tl.dot(x_odd, c_lo, tl.dot(x_even, c_hi)) * absmax[None, :]
    return acc


@triton.jit
def _quant_gate_up_kernel(
    x_ptr,  # [N, H] rows of the tokens
    order_ptr,  # [A] int64: assignment index (token * TOP_K + choice) in expert-sorted order
    bounds_ptr,  # [E + 1] int64: expert e's assignments are order[bounds[e]:bounds[e + 1]]
    tables_ptr,  # [4, E] int64 address tables of gate_up (ProjectionTables)
    offsets_ptr,  # [E] fp32 NF4 absmax offsets
    pair_ptr,  # [256] int32 NF4 pair table (NF4Weight.pair_levels)
    act_ptr,  # [A, I] out, rows in sorted order
    E,
    H: tl.constexpr,
    INTER: tl.constexpr,
    stride_x,
    TOP_K: tl.constexpr,
    NF4: tl.constexpr,
    PAIR: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    e = tl.program_id(0)
    nb = tl.program_id(1)
    start = tl.load(bounds_ptr + e)
    end = tl.load(bounds_ptr + e + 1)
    dt = x_ptr.dtype.element_ty
    offset = tl.load(offsets_ptr + e)
    rn = nb * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN] gate rows (up rows at + INTER)
    mask_n = rn < INTER
    m0 = start
    while m0 < end:  # a while loop: the bounds are loaded values
        rm = m0 + tl.arange(0, BLOCK_M)  # [BM] sorted assignment rows
        mask_m = rm < end
        token = tl.load(order_ptr + rm, mask=mask_m, other=0) // TOP_K  # [BM]
        acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, H, BLOCK_K):
            if PAIR:
                x_rows = token.to(tl.int64) * stride_x
                acc_g = _nf4_pair_dot(acc_g, x_ptr, x_rows, mask_m, tables_ptr, E, e, pair_ptr, offset, rn, mask_n, k0,
                                      H, BLOCK_K)  # fmt: skip
                acc_u = _nf4_pair_dot(acc_u, x_ptr, x_rows, mask_m, tables_ptr, E, e, pair_ptr, offset, rn + INTER,
                                      mask_n, k0, H, BLOCK_K)  # fmt: skip
            else:
                rk = k0 + tl.arange(0, BLOCK_K)
                xt = tl.load(
                    x_ptr + token[:, None] * stride_x + rk[None, :], mask=mask_m[:, None] & (rk < H)[None, :], other=0.0
                )  # [BM, BK]
                wg = _int8_tile(tables_ptr, e, rn, mask_n, k0, H, BLOCK_K, x_ptr)
                wu = _int8_tile(tables_ptr, e, rn + INTER, mask_n, k0, H, BLOCK_K, x_ptr)
                acc_g = tl.dot(xt, wg, acc_g)
                acc_u = tl.dot(xt, wu, acc_u)
        if not NF4:  # Int8: each output column times its row absmax / 127
            acc_g = acc_g * _column_scales(tables_ptr, E, e, rn, mask_n)[None, :]
            acc_u = acc_u * _column_scales(tables_ptr, E, e, rn + INTER, mask_n)[None, :]
        g = acc_g.to(dt).to(tl.float32)  # the projection's output in the compute dtype, as the reference
        u = acc_u.to(dt).to(tl.float32)
        silu = (g * tl.sigmoid(g)).to(dt).to(tl.float32)  # rounded as F.silu's output
        act = (silu * u).to(dt)  # [BM, BN]
        tl.store(act_ptr + rm[:, None].to(tl.int64) * INTER + rn[None, :], act, mask=mask_m[:, None] & mask_n[None, :])
        m0 += BLOCK_M


@triton.jit
def _quant_down_kernel(
    act_ptr,  # [A, I] rows in sorted order
    order_ptr,  # [A] int64
    bounds_ptr,  # [E + 1] int64
    tables_ptr,  # [4, E] int64 address tables of down
    offsets_ptr,  # [E] fp32
    pair_ptr,  # [256] int32
    weights_ptr,  # [A] fp32 routing weight of each assignment (unsorted)
    out_ptr,  # SPLITS == 1: [A, H] fp32 weighted outputs; else [SPLITS, A, H] fp32 partial sums (rows by assignment)
    E,
    A,
    H: tl.constexpr,
    INTER: tl.constexpr,
    NF4: tl.constexpr,
    PAIR: tl.constexpr,
    SPLITS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    e = tl.program_id(0)
    nb = tl.program_id(1)
    split = tl.program_id(2)  # this program's share of INTER: whole BLOCK_K steps, the splits in order
    steps: tl.constexpr = (INTER + BLOCK_K - 1) // BLOCK_K
    per_split: tl.constexpr = (steps + SPLITS - 1) // SPLITS
    k_lo = split * per_split * BLOCK_K
    k_hi = tl.minimum((split + 1) * per_split, steps) * BLOCK_K
    start = tl.load(bounds_ptr + e)
    end = tl.load(bounds_ptr + e + 1)
    dt = act_ptr.dtype.element_ty
    offset = tl.load(offsets_ptr + e)
    rn = nb * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN] hidden columns
    mask_n = rn < H
    m0 = start
    while m0 < end:
        rm = m0 + tl.arange(0, BLOCK_M)
        mask_m = rm < end
        assignment = tl.load(order_ptr + rm, mask=mask_m, other=0)  # [BM]
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            if PAIR:
                acc = _nf4_pair_dot(acc, act_ptr, rm.to(tl.int64) * INTER, mask_m, tables_ptr, E, e, pair_ptr, offset,
                                    rn, mask_n, k0, INTER, BLOCK_K)  # fmt: skip
            else:
                rk = k0 + tl.arange(0, BLOCK_K)
                at = tl.load(
                    act_ptr + rm[:, None].to(tl.int64) * INTER + rk[None, :],
                    mask=mask_m[:, None] & (rk < INTER)[None, :],
                    other=0.0,
                )  # [BM, BK]
                wd = _int8_tile(tables_ptr, e, rn, mask_n, k0, INTER, BLOCK_K, act_ptr)
                acc = tl.dot(at, wd, acc)
        if not NF4:
            acc = acc * _column_scales(tables_ptr, E, e, rn, mask_n)[None, :]
        out_mask = mask_m[:, None] & mask_n[None, :]
        if SPLITS == 1:
            scale = tl.load(weights_ptr + assignment, mask=mask_m, other=0.0)  # [BM] fp32
            y = acc.to(dt).to(tl.float32) * scale[:, None]  # expert output rounded, then weighted (as the reference)
            tl.store(out_ptr + assignment[:, None] * H + rn[None, :], y, mask=out_mask)
        else:  # the partial sum; grouped_quant_experts adds the splits in order, rounds and weights
            tl.store(out_ptr + (split * A + assignment[:, None]) * H + rn[None, :], acc, mask=out_mask)
        m0 += BLOCK_M


def grouped_quant_experts(
    x: torch.Tensor,
    expert_ids: torch.Tensor,
    expert_weights: torch.Tensor,
    experts: QuantizedExpertWeights,
    config: tuple[int, ...],
) -> torch.Tensor:
    """`moe.experts_forward` on CUDA for quantized experts (inputs already checked there): x [N, H], expert_ids
    [N, k], expert_weights [N, k] fp32 -> [N, H] in x's dtype. ValueError for a config not in the list."""
    if config not in configs_for(experts.kind):
        raise ValueError(f"{config} is not a config for {experts.kind} experts ({configs_for(experts.kind)})")
    n, h = x.shape
    k = expert_ids.shape[1]
    inter = experts.intermediate_size
    num_experts = experts.num_experts
    nf4 = experts.kind == "nf4"
    block_n, block_k, warps, stages, pair, splits = config
    if x.stride(1) != 1:
        x = x.contiguous()
    flat = expert_ids.reshape(-1).long()  # [A = N k]
    sorted_ids, order = torch.sort(flat, stable=True)  # [A] each
    bounds = torch.searchsorted(sorted_ids, experts.boundaries)  # [E + 1]; ids outside [0, E) fall outside
    act = torch.empty((n * k, inter), dtype=x.dtype, device=x.device)  # [A, I]
    out = torch.zeros((splits, n * k, h), dtype=torch.float32, device=x.device)  # [S, A, H]
    gu, dn = experts.gate_up_tables, experts.down_tables
    _quant_gate_up_kernel[(num_experts, triton.cdiv(inter, block_n))](
        x, order, bounds, gu.addresses, gu.offsets, experts.pair_levels, act, num_experts, h, inter,
        x.stride(0), TOP_K=k, NF4=nf4, PAIR=bool(pair), BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=warps, num_stages=stages,
    )  # fmt: skip
    weights = expert_weights.reshape(-1).contiguous()  # [A] fp32
    _quant_down_kernel[(num_experts, triton.cdiv(h, block_n), splits)](
        act, order, bounds, dn.addresses, dn.offsets, experts.pair_levels, weights, out, num_experts,
        n * k, h, inter, NF4=nf4, PAIR=bool(pair), SPLITS=splits, BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=warps, num_stages=stages,
    )  # fmt: skip
    if splits == 1:
        y = out[0]  # [A, H] weighted expert outputs
    else:  # splits summed in order (no atomics), the expert output rounded, then weighted (as the kernel's epilogue)
        y = out.sum(dim=0).to(x.dtype).float() * weights[:, None]  # [A, H] fp32
    return y.view(n, k, h).sum(dim=1).to(x.dtype)  # [N, H]
