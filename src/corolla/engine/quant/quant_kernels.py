"""Triton dequantize-GEMM kernels for few-row inputs (decode steps of up to `QUANT_KERNEL_MAX_ROWS` rows) reading
the NF4 and Int8 layouts of `engine.quant.quant_weights` in place: out[M, N] = x[M, K] @ W[N, K]^T (+ residual). DecodeOps runs
them for merged steps of more than `quant_gemv.GEMV_MAX_ROWS` rows, and INT8's fewer rows where tuned (or untuned).

Batch invariance: every 16-row tile of the output is computed with the same instruction sequence and the same K
order (an NF4 program may carry up to four such tiles to read its weight bytes once), and a split of K (when the
tuned config has one) is summed in split order by the last program of each output tile to finish (`quant_splits`:
an arrival count per tile, no second kernel): no choice that depends on M or on which program finishes last. A
row's output is therefore bit-identical whether it runs alone or merged with other sessions' rows. CUDA-graph safe: static shapes, no host synchronization. Importing fails without
Triton."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from corolla.engine.kernels.quant_splits import (
    arrive_last,
    reset_counter,
    rstd_of,
    split_rstd,
    sum_split_tile,
)
from corolla.engine.quant.prologues import PROLOGUES, check_prologue
from corolla.engine.quant.quant_weights import NF4_BLOCK_VALUES, Int8Weight, NF4Weight, counters_for_tiles

QUANT_KERNEL_MAX_ROWS = 64  # larger inputs (prefill) dequantize the weight and use cuBLAS
TILE_M = 16

# (BLOCK_N, BLOCK_K values, SPLIT_K, num_warps, num_stages), timed per weight shape at warm-up on one row (against
# quant_gemv's kernels, for steps of up to quant_gemv.GEMV_MAX_ROWS rows) and on 64 rows (against the NF4 tile kernel's,
# for larger merged steps) by DecodeOps.tune_quantized. On an H100 the 64-wide tile won every Llama-3-8B projection
# at 64 rows; the narrow ones serve one row (INT8 at 1.58x its floor; [32, 128] won INT8's w_o and w_down with 4
# splits, w_down with 8 once the split sums moved into the kernel: 25.2 us vs 26.7; 2 splits won nothing).
QUANT_CONFIGS: tuple[tuple[int, int, int, int, int], ...] = (
    (16, 128, 1, 4, 3),
    (16, 256, 1, 4, 3),
    (32, 128, 1, 4, 3),
    (16, 128, 2, 4, 3),
    (16, 256, 4, 4, 3),
    (32, 128, 4, 4, 3),
    (32, 128, 8, 4, 3),
    (64, 128, 4, 4, 3),
    (16, 128, 8, 4, 3),
    (32, 256, 2, 8, 3),
)
DEFAULT_CONFIG = (64, 128, 4, 4, 3)


@triton.jit
def _store_tile(acc, offs_m, offs_n, M, N, split, ws_ptr, res_ptr, cs_ptr, out_ptr, stride_rm, stride_om,
                SPLIT: tl.constexpr, HAS_RES: tl.constexpr, HAS_SCALE: tl.constexpr):  # fmt: skip
    # SPLIT == 1: the finished tile (column scale, residual, cast); else fp32 partial sums into ws[split, M, N]
    mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    if SPLIT == 1:
        if HAS_SCALE:
            acc = acc * tl.load(cs_ptr + offs_n, mask=offs_n < N, other=0.0)[None, :]
        if HAS_RES:
            acc += tl.load(res_ptr + offs_m[:, None] * stride_rm + offs_n[None, :], mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(ws_ptr + (split * M + offs_m[:, None]) * N + offs_n[None, :], acc, mask=mask)


@triton.jit
def _nf4_block_dot(x_ptr, offs_m, M, stride_xm, cols, valid, c_hi, c_lo, scale):
    # one 16-row tile's contribution of one 64-value block: scale * (x_even @ levels_hi + x_odd @ levels_lo)
    xm = (offs_m < M)[:, None] & valid
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + cols[None, :]
    x_even = tl.load(x_ptrs, mask=xm, other=0.0)  # [16, 32]
    x_odd = tl.load(x_ptrs + 1, mask=xm, other=0.0)
    part = tl.dot(x_odd, c_lo, tl.dot(x_even, c_hi))  # [16, BLOCK_N] fp32
    return part * scale[None, :]


@triton.jit
def _nf4_gemm_kernel(
    x_ptr,
    q_ptr,
    aq_ptr,
    na_ptr,
    nc_ptr,
    code_ptr,
    ws_ptr,
    res_ptr,
    out_ptr,
    cnt_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_rm,
    stride_om,
    offset,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT: tl.constexpr,
    HAS_RES: tl.constexpr,
    TILES: tl.constexpr,
):
    # code_ptr: int32 [256] pair table of the levels in x's dtype (NF4Weight.pair_levels).
    # ws[split, M, N] (fp32) = x[M, K-range of split] @ dequant(W)[N, K-range]^T for TILES 16-row tiles and
    # BLOCK_N columns. W bytes: row n, byte j holds elements 2j (high nibble) and 2j+1 (low nibble); per 64-value
    # block (32 bytes) the levels multiply x's even and odd columns in two dots and the block's absmax scales the
    # result (no dequantized weight tile is built). Each 16-row tile runs the same instructions whatever TILES is.
    pid = tl.program_id(0)
    split = tl.program_id(1)
    num_m = tl.cdiv(M, 16 * TILES)
    pid_m = pid % num_m  # the M groups of one N tile run next to each other (their weight bytes hit L2)
    pid_n = pid // num_m
    NB: tl.constexpr = BLOCK_K // 64  # absmax blocks per K step
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_t = tl.arange(0, 32)
    offs_m0 = pid_m * 16 * TILES + tl.arange(0, 16)
    kb = K // 64  # absmax blocks per row
    steps = tl.cdiv(kb, NB)
    per_split = tl.cdiv(steps, SPLIT)
    dt = x_ptr.dtype.element_ty
    acc0 = tl.zeros([16, BLOCK_N], dtype=tl.float32)
    acc1 = tl.zeros([16, BLOCK_N], dtype=tl.float32)
    acc2 = tl.zeros([16, BLOCK_N], dtype=tl.float32)
    acc3 = tl.zeros([16, BLOCK_N], dtype=tl.float32)
    for step in range(split * per_split, tl.minimum((split + 1) * per_split, steps)):
        for b in tl.static_range(NB):
            blk = step * NB + b
            valid = blk < kb
            bmask = n_mask & valid
            byte = tl.load(
                q_ptr + offs_n[None, :] * (K // 2) + blk * 32 + offs_t[:, None], mask=bmask[None, :], other=0
            )
            # one gather per byte from the 256-entry pair table: (level(hi) bits << 16) | level(lo) bits
            pair = tl.load(code_ptr + byte.to(tl.int32))  # [32, BLOCK_N] int32
            c_hi = (pair >> 16).to(tl.int16).to(dt, bitcast=True)
            c_lo = (pair & 0xFFFF).to(tl.int16).to(dt, bitcast=True)
            gb = offs_n * kb + blk  # [BLOCK_N] absmax block of each column
            aq = tl.load(aq_ptr + gb, mask=bmask, other=0).to(tl.int32)
            scale = tl.load(nc_ptr + aq) * tl.load(na_ptr + gb // 256, mask=bmask, other=0.0) + offset
            cols = blk * 64 + 2 * offs_t  # [32] even columns of x
            acc0 += _nf4_block_dot(x_ptr, offs_m0, M, stride_xm, cols, valid, c_hi, c_lo, scale)
            if TILES >= 2:
                acc1 += _nf4_block_dot(x_ptr, offs_m0 + 16, M, stride_xm, cols, valid, c_hi, c_lo, scale)
            if TILES >= 4:
                acc2 += _nf4_block_dot(x_ptr, offs_m0 + 32, M, stride_xm, cols, valid, c_hi, c_lo, scale)
                acc3 += _nf4_block_dot(x_ptr, offs_m0 + 48, M, stride_xm, cols, valid, c_hi, c_lo, scale)
    _store_tile(acc0, offs_m0, offs_n, M, N, split, ws_ptr, res_ptr, ws_ptr, out_ptr, stride_rm, stride_om,
                SPLIT, HAS_RES, False)  # fmt: skip
    if TILES >= 2:
        _store_tile(acc1, offs_m0 + 16, offs_n, M, N, split, ws_ptr, res_ptr, ws_ptr, out_ptr, stride_rm, stride_om,
                    SPLIT, HAS_RES, False)  # fmt: skip
    if TILES >= 4:
        _store_tile(acc2, offs_m0 + 32, offs_n, M, N, split, ws_ptr, res_ptr, ws_ptr, out_ptr, stride_rm, stride_om,
                    SPLIT, HAS_RES, False)  # fmt: skip
        _store_tile(acc3, offs_m0 + 48, offs_n, M, N, split, ws_ptr, res_ptr, ws_ptr, out_ptr, stride_rm, stride_om,
                    SPLIT, HAS_RES, False)  # fmt: skip
    if SPLIT > 1:  # the last program of this output tile sums the splits in split order (quant_splits)
        if arrive_last(cnt_ptr, pid, SPLIT):
            sum_split_tile(offs_m0, offs_n, M, N, SPLIT, ws_ptr, res_ptr, ws_ptr, out_ptr, stride_rm, stride_om, 1.0,
                           HAS_RES, False, False)  # fmt: skip
            if TILES >= 2:
                sum_split_tile(offs_m0 + 16, offs_n, M, N, SPLIT, ws_ptr, res_ptr, ws_ptr, out_ptr, stride_rm,
                               stride_om, 1.0, HAS_RES, False, False)  # fmt: skip
            if TILES >= 4:
                sum_split_tile(offs_m0 + 32, offs_n, M, N, SPLIT, ws_ptr, res_ptr, ws_ptr, out_ptr, stride_rm,
                               stride_om, 1.0, HAS_RES, False, False)  # fmt: skip
                sum_split_tile(offs_m0 + 48, offs_n, M, N, SPLIT, ws_ptr, res_ptr, ws_ptr, out_ptr, stride_rm,
                               stride_om, 1.0, HAS_RES, False, False)  # fmt: skip
            reset_counter(cnt_ptr, pid)


@triton.jit
def _int8_gemm_kernel(
    x_ptr,
    w_ptr,
    ws_ptr,
    res_ptr,
    cs_ptr,
    out_ptr,
    cnt_ptr,
    nw_ptr,
    ss_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_rm,
    stride_om,
    eps,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT: tl.constexpr,
    HAS_RES: tl.constexpr,
    PRO: tl.constexpr,
):
    # ws[split, M, N] (fp32) = f(x)[M, K-range] @ codes[N, K-range]^T (int8 codes are exact in bf16/fp16); f: the
    # prologue PRO (prologues.PROLOGUES): RMSNorm's gain nw[k] with the sums of squares ss[split, M, N tiles] of
    # the K range (its 1/rms scales the finished sum)
    pid = tl.program_id(0)
    split = tl.program_id(1)
    num_m = tl.cdiv(M, 16)
    pid_m = pid % num_m
    pid_n = pid // num_m
    offs_m = pid_m * 16 + tl.arange(0, 16)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    steps = tl.cdiv(K, BLOCK_K)
    per_split = tl.cdiv(steps, SPLIT)
    dt = x_ptr.dtype.element_ty
    acc = tl.zeros([16, BLOCK_N], dtype=tl.float32)
    sq = tl.zeros([16], dtype=tl.float32)  # RMSNorm: sum of x^2 over this program's K range, per row
    for step in range(split * per_split, tl.minimum((split + 1) * per_split, steps)):
        offs_k = step * BLOCK_K + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        w = tl.load(w_ptr + offs_n[None, :] * K + offs_k[:, None], mask=k_mask[:, None] & n_mask[None, :], other=0)
        x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]
        xm = m_mask[:, None] & k_mask[None, :]
        if PRO == 1:
            xf = tl.load(x_ptrs, mask=xm, other=0.0).to(tl.float32)  # [16, BLOCK_K]
            sq += tl.sum(xf * xf, axis=1)
            x = (xf * tl.load(nw_ptr + offs_k, mask=k_mask, other=0.0).to(tl.float32)[None, :]).to(dt)
        else:
            x = tl.load(x_ptrs, mask=xm)
        acc = tl.dot(x, w.to(dt), acc)
    n_tiles = tl.cdiv(N, BLOCK_N)
    if PRO == 1:
        if SPLIT == 1:
            acc = acc * rstd_of(sq, K, eps)[:, None]
        else:
            tl.store(ss_ptr + (split * M + offs_m) * n_tiles + pid_n, sq, mask=m_mask)
    _store_tile(acc, offs_m, offs_n, M, N, split, ws_ptr, res_ptr, cs_ptr, out_ptr, stride_rm, stride_om,
                SPLIT, HAS_RES, True)  # fmt: skip
    if SPLIT > 1:  # the last program of this output tile sums the splits in split order (quant_splits)
        if arrive_last(cnt_ptr, pid, SPLIT):
            rs = 1.0
            if PRO == 1:
                rs = split_rstd(ss_ptr, offs_m, pid_n, M, n_tiles, SPLIT, K, eps)
            sum_split_tile(offs_m, offs_n, M, N, SPLIT, ws_ptr, res_ptr, cs_ptr, out_ptr, stride_rm, stride_om, rs,
                           HAS_RES, True, PRO == 1)  # fmt: skip
            reset_counter(cnt_ptr, pid)


def quant_matmul(
    x: torch.Tensor,
    weight: NF4Weight | Int8Weight,
    residual: torch.Tensor | None,
    config: tuple[int, int, int, int, int] = DEFAULT_CONFIG,
    prologue: int = 0,
    norm_weight: torch.Tensor | None = None,
    eps: float = 0.0,
) -> torch.Tensor:
    """f(x) [M, K] (M <= QUANT_KERNEL_MAX_ROWS, last dim contiguous, the weight's dtype) @ W[N, K]^T (+ residual
    [M, N]) -> [M, N] in the weight's dtype; f = `prologue` (prologues.PROLOGUES, INT8 only): the identity or
    RMSNorm with `norm_weight` [K] and `eps`."""
    m, kx = x.shape
    n, k = weight.shape
    if kx != k or m > QUANT_KERNEL_MAX_ROWS or x.stride(1) != 1:
        raise ValueError(f"quant_matmul takes [<= {QUANT_KERNEL_MAX_ROWS}, {k}] contiguous rows, got {tuple(x.shape)}")
    check_prologue(k, prologue, norm_weight)
    if prologue and isinstance(weight, NF4Weight):
        raise ValueError("quant_matmul runs a prologue on INT8 weights only")
    block_n, block_k, split, warps, stages = config
    if block_n < 16 or block_k < 16 or split < 1:
        raise ValueError(f"bad quant_matmul config {config}")
    out = torch.empty((m, n), dtype=weight.dtype, device=x.device)
    ws = torch.empty((split, m, n), dtype=torch.float32, device=x.device) if split > 1 else out  # [S, M, N]
    res = residual if residual is not None else out
    if isinstance(weight, NF4Weight):
        if block_k % NF4_BLOCK_VALUES:
            raise ValueError(f"NF4 BLOCK_K must be a multiple of {NF4_BLOCK_VALUES}")
        tiles = 1 if m <= TILE_M else 2 if m <= 2 * TILE_M else 4  # 16-row tiles sharing one read of the weight
        grid = (triton.cdiv(m, TILE_M * tiles) * triton.cdiv(n, block_n), split)
    else:
        grid = (triton.cdiv(m, TILE_M) * triton.cdiv(n, block_n), split)
    # [split_counter_slots(N)] int32 arrival counts of the output tiles (not read without a split)
    counters = counters_for_tiles(weight, grid[0]) if split > 1 else ws
    if isinstance(weight, NF4Weight):
        _nf4_gemm_kernel[grid](
            x, weight.packed, weight.absmax_codes, weight.nested_absmax, weight.nested_code, weight.pair_levels, ws,
            res, out, counters, m, n, k, x.stride(0), res.stride(0), out.stride(0), weight.nested_offset,
            BLOCK_N=block_n, BLOCK_K=block_k, SPLIT=split, HAS_RES=residual is not None, TILES=tiles,
            num_warps=warps, num_stages=stages,
        )  # fmt: skip
    else:
        norm = prologue == PROLOGUES["rmsnorm"] and split > 1  # [split, M, N tiles] fp32 partial sums of squares
        ss = torch.empty((split, m, triton.cdiv(n, block_n)), dtype=torch.float32, device=x.device) if norm else ws
        _int8_gemm_kernel[grid](
            x, weight.codes, ws, res, weight.col_scale, out, counters, norm_weight if prologue == 1 else ws, ss,
            m, n, k, x.stride(0), res.stride(0), out.stride(0), eps, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT=split,
            HAS_RES=residual is not None, PRO=prologue, num_warps=warps, num_stages=stages,
        )  # fmt: skip
    return out


@triton.jit
def _nf4_dequant_kernel(q_ptr, aq_ptr, na_ptr, nc_ptr, code_ptr, out_ptr, total_bytes, offset, BLOCK: tl.constexpr):
    # out (flat, element order) from the packed bytes; BLOCK bytes per program
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < total_bytes
    byte = tl.load(q_ptr + offs, mask=mask, other=0)
    blk = offs // 32
    aq = tl.load(aq_ptr + blk, mask=mask, other=0).to(tl.int32)
    scale = tl.load(nc_ptr + aq) * tl.load(na_ptr + blk // 256, mask=mask, other=0.0) + offset
    hi = (tl.load(code_ptr + (byte >> 4).to(tl.int32)) * scale).to(out_ptr.dtype.element_ty)
    lo = (tl.load(code_ptr + (byte & 15).to(tl.int32)) * scale).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + 2 * offs, hi, mask=mask)
    tl.store(out_ptr + 2 * offs + 1, lo, mask=mask)


def nf4_dequantize(weight: NF4Weight) -> torch.Tensor:
    """[N, K] in the weight's dtype, equal to `weight.dequantize()`, in one kernel."""
    n, k = weight.shape
    out = torch.empty((n, k), dtype=weight.dtype, device=weight.device)
    total = weight.packed.numel()
    block = 1024
    _nf4_dequant_kernel[(triton.cdiv(total, block),)](
        weight.packed, weight.absmax_codes, weight.nested_absmax, weight.nested_code, weight.code, out,
        total, weight.nested_offset, BLOCK=block,
    )  # fmt: skip
    return out
