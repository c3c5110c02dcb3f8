"""Triton dequantize-GEMV kernels for decode steps of a few rows (up to `GEMV_MAX_ROWS`), reading the NF4 and Int8
layouts of `engine.quant.quant_weights` in place without the matrix units: out[M, N] = x[M, K] @ W[N, K]^T (+ residual).

Why not `tl.dot`: at one to a few rows a matrix instruction wastes 15/16 of its work and forces the decoded weight
tile through a shared-memory layout change; here each program streams a [BLOCK_N, bytes] tile of packed weight
rows with 16-byte loads, decodes it in registers and multiplies in fp32 on the CUDA cores (bound by the decode:
docs/decisions/0017).

NF4 decode: each nibble looked up in the 16-entry fp32 level table (64 bytes: one cache line, so a warp's lookups
are served in one L1 pass); the two nibbles are interleaved back into element order in registers (`tl.join`), each
64-value block is summed against x and scaled once by its decoded absmax (uint8 code -> nested code table *
second-level absmax + offset), accumulated in fp32. This serves NF4 weights kept in fp32 (and steps before tuning);
NF4 in 16-bit dtypes runs on the matrix units instead (quant_tile_gemv, quant_mma: 0015, 0017, 0060).

Batch invariance: a row's output is computed by the same instructions in the same K order whatever the other
rows are: programs take ROWS rows each (1, 2 or 4, by M) and each row has its own accumulator, reduced in a
fixed order; a split of K is summed in split order by the last program of each output tile to finish (an
arrival count per tile, `quant_splits`). DecodeOps tunes one (kernel, config) per weight shape and row range; the
ranges round differently, so a row's output depends on which range its step fell in (each within fp32-accumulation
error of the reference), never on the other rows' values.
CUDA-graph safe: static shapes, no host synchronization. Importing fails without Triton."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from corolla.engine.kernels.quant_splits import (
    PROLOGUES,
    check_prologue,
    finish_row,
    finish_split_rows,
    prologue_width,
    prologue_x,
    rows_per_program,
    rstd_of,
)
from corolla.engine.quant.quant_weights import Int8Weight, NF4Weight, counters_for_tiles

GEMV_MAX_ROWS = 8  # decode steps of at most this many rows run here, larger ones on quant_kernels' tl.dot kernel

# (BLOCK_N, 64-value blocks per step, K splits, num_warps, 0) for NF4 (the fp32 table GEMV); (BLOCK_N, BLOCK_K, K
# splits, num_warps, 0) for Int8 (the byte GEMV). Splits are a run-time argument. The byte GEMV's tilings are those
# that won or came within 4% of an H100's best on some Llama-3-8B shape (docs/decisions/0017; each candidate costs
# warm-up time).
NF4_GEMV_CONFIGS: tuple[tuple[int, int, int, int, int], ...] = ((32, 2, 8, 4, 0),)
INT8_GEMV_CONFIGS: tuple[tuple[int, int, int, int, int], ...] = (
    *((8, 256, s, 4, 0) for s in (1, 2, 4, 8)),
    (16, 128, 4, 4, 0),
)
DEFAULT_NF4_CONFIG = NF4_GEMV_CONFIGS[0]  # before (or without) tuning
DEFAULT_INT8_CONFIG = (8, 256, 2, 4, 0)


def fusable(int8: bool, config: tuple[int, int, int, int, int]) -> bool:
    """Whether the GEMV for `config` on an INT8 (`int8`) or NF4 weight runs a prologue (RMSNorm / SiLU gating,
    quant_splits): the INT8 byte GEMV only."""
    return int8 and config in INT8_GEMV_CONFIGS and config[4] == 0


@triton.jit
def _nf4_row_block_sums(w, x_ptr, row, M, stride_xm, k0, K, NB: tl.constexpr):
    # w [BLOCK_N, NB, 64] fp32 levels; x[row, k0 : k0 + 64 NB] -> [BLOCK_N, NB] per-block dot products
    offs_k = k0 + tl.arange(0, NB * 64)
    xr = tl.load(x_ptr + row * stride_xm + offs_k, mask=(offs_k < K) & (row < M), other=0.0).to(tl.float32)
    return tl.sum(w * tl.reshape(xr, [NB, 64])[None, :, :], axis=2)


@triton.jit
def _nf4_gemv_kernel(
    x_ptr,
    q_ptr,
    aq_ptr,
    na_ptr,
    nc_ptr,
    lut_ptr,  # [16] fp32 levels
    ws_ptr,
    res_ptr,
    out_ptr,
    cnt_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_qn,
    stride_rm,
    stride_om,
    offset,
    splits,
    BLOCK_N: tl.constexpr,
    NB: tl.constexpr,
    ROWS: tl.constexpr,
    USE_WS: tl.constexpr,
    HAS_RES: tl.constexpr,
):
    # program (n tile, split, row group): rows pid_m * ROWS + [0, ROWS) against W[n tile, k-range of the split].
    # Packed row n: byte j holds element 2j (high nibble) and 2j + 1 (low nibble); absmax block b of row n is
    # absmax_codes[n * K / 64 + b], its second-level absmax nested[(n * K / 64 + b) // 256].
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    row0 = tl.program_id(2) * ROWS
    BB: tl.constexpr = NB * 32  # packed bytes per row per step
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_bb = tl.arange(0, BB)
    offs_nb = tl.arange(0, NB)
    kb = K // 64  # absmax blocks per row
    row_bytes = K // 2
    steps = tl.cdiv(kb, NB)
    per_split = tl.cdiv(steps, splits)
    acc0 = tl.zeros([BLOCK_N, NB], dtype=tl.float32)
    acc1 = tl.zeros([BLOCK_N, NB], dtype=tl.float32)
    acc2 = tl.zeros([BLOCK_N, NB], dtype=tl.float32)
    acc3 = tl.zeros([BLOCK_N, NB], dtype=tl.float32)
    for step in range(split * per_split, tl.minimum((split + 1) * per_split, steps)):
        b0 = step * NB  # first absmax block of this step
        cols = b0 * 32 + offs_bb  # [BB] byte columns
        byte = tl.load(
            q_ptr + offs_n[:, None] * stride_qn + cols[None, :],
            mask=n_mask[:, None] & (cols < row_bytes)[None, :],
            other=0,
        )  # [BLOCK_N, BB] uint8
        hi = tl.load(lut_ptr + (byte >> 4).to(tl.int32))  # [BLOCK_N, BB] fp32
        lo = tl.load(lut_ptr + (byte & 15).to(tl.int32))
        w = tl.reshape(tl.join(hi, lo), [BLOCK_N, NB, 64])  # [BLOCK_N, NB, 64] levels in element order
        gb = offs_n[:, None] * kb + b0 + offs_nb[None, :]  # [BLOCK_N, NB] absmax block index
        smask = n_mask[:, None] & ((b0 + offs_nb) < kb)[None, :]
        aq = tl.load(aq_ptr + gb, mask=smask, other=0).to(tl.int32)
        scale = tl.load(nc_ptr + aq) * tl.load(na_ptr + gb // 256, mask=smask, other=0.0) + offset  # [BLOCK_N, NB]
        k0 = b0 * 64
        acc0 += _nf4_row_block_sums(w, x_ptr, row0, M, stride_xm, k0, K, NB) * scale
        if ROWS >= 2:
            acc1 += _nf4_row_block_sums(w, x_ptr, row0 + 1, M, stride_xm, k0, K, NB) * scale
        if ROWS >= 4:
            acc2 += _nf4_row_block_sums(w, x_ptr, row0 + 2, M, stride_xm, k0, K, NB) * scale
            acc3 += _nf4_row_block_sums(w, x_ptr, row0 + 3, M, stride_xm, k0, K, NB) * scale
    finish_row(tl.sum(acc0, axis=1), row0, offs_n, M, N, split, ws_ptr, res_ptr, ws_ptr, out_ptr, stride_rm,
                stride_om, USE_WS, HAS_RES, False)  # fmt: skip
    if ROWS >= 2:
        finish_row(tl.sum(acc1, axis=1), row0 + 1, offs_n, M, N, split, ws_ptr, res_ptr, ws_ptr, out_ptr,
                    stride_rm, stride_om, USE_WS, HAS_RES, False)  # fmt: skip
    if ROWS >= 4:
        finish_row(tl.sum(acc2, axis=1), row0 + 2, offs_n, M, N, split, ws_ptr, res_ptr, ws_ptr, out_ptr,
                    stride_rm, stride_om, USE_WS, HAS_RES, False)  # fmt: skip
        finish_row(tl.sum(acc3, axis=1), row0 + 3, offs_n, M, N, split, ws_ptr, res_ptr, ws_ptr, out_ptr,
                    stride_rm, stride_om, USE_WS, HAS_RES, False)  # fmt: skip
    if USE_WS:  # K split: the tile's last program sums the splits (quant_splits)
        finish_split_rows(cnt_ptr, tl.program_id(2) * tl.num_programs(0) + pid_n, splits, row0, offs_n, M, N,
                          ws_ptr, res_ptr, ws_ptr, out_ptr, stride_rm, stride_om, ws_ptr, 0, 1, K,
                          0.0, ROWS, HAS_RES, False, False)  # fmt: skip


@triton.jit
def _int8_row_products(w, x_ptr, nw_ptr, row, M, stride_xm, offs_k, K, PRO: tl.constexpr):
    # w [BLOCK_N, BLOCK_K] fp32 codes; f(x)[row, offs_k] (prologue PRO, quant_splits.PROLOGUES) -> [BLOCK_N,
    # BLOCK_K] products and [BLOCK_K] squares of x (RMSNorm's statistics; zeros otherwise)
    xr, sq = prologue_x(x_ptr, nw_ptr, row, M, stride_xm, offs_k, K, PRO)
    return w * xr[None, :], sq


@triton.jit
def row_end(vals, sq, row, offs_n, M, N, K, eps, pid_n, split, ws_ptr, ss_ptr, res_ptr, cs_ptr, out_ptr, stride_rm,
             stride_om, USE_WS: tl.constexpr, HAS_RES: tl.constexpr, HAS_SCALE: tl.constexpr,
             PRO: tl.constexpr):  # fmt: skip
    # one row's sums vals [BLOCK_N]: finished (RMSNorm: times the row's 1/rms from sq, its sum of x^2, when this
    # program covers all of K) or stored as a split's partial sums (RMSNorm: with sq at ss[split, row, pid_n])
    if PRO == 1:
        if USE_WS:
            tl.store(ss_ptr + (split * M + row) * tl.num_programs(0) + pid_n, sq, mask=row < M)
        else:
            vals = vals * rstd_of(sq, K, eps)
    finish_row(vals, row, offs_n, M, N, split, ws_ptr, res_ptr, cs_ptr, out_ptr, stride_rm, stride_om, USE_WS,
                HAS_RES, HAS_SCALE)  # fmt: skip


@triton.jit
def _int8_gemv_kernel(
    x_ptr,
    w_ptr,
    cs_ptr,
    ws_ptr,
    res_ptr,
    out_ptr,
    cnt_ptr,
    nw_ptr,
    ss_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_rm,
    stride_om,
    splits,
    eps,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    ROWS: tl.constexpr,
    USE_WS: tl.constexpr,
    HAS_RES: tl.constexpr,
    PRO: tl.constexpr,
):
    # program (n tile, split, row group): per-element fp32 accumulators over the split's K range, summed once at
    # the end; the output scale (row absmax / 127) is applied to the finished sum. PRO: the prologue (RMSNorm's
    # gain nw [K] and statistics, or SiLU gating of x [M, 2K]; quant_splits)
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    row0 = tl.program_id(2) * ROWS
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    steps = tl.cdiv(K, BLOCK_K)
    per_split = tl.cdiv(steps, splits)
    acc0 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    acc1 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    acc2 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    acc3 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    sq0 = tl.zeros([BLOCK_K], dtype=tl.float32)  # RMSNorm: x^2 of each row over the split's K range
    sq1 = tl.zeros([BLOCK_K], dtype=tl.float32)
    sq2 = tl.zeros([BLOCK_K], dtype=tl.float32)
    sq3 = tl.zeros([BLOCK_K], dtype=tl.float32)
    lo = split * per_split
    hi = tl.minimum(lo + per_split, steps)
    offs_k0 = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + offs_n[:, None] * stride_wn + offs_k0[None, :]
    # the split's K end: k < k_end is (k < K and step < hi) without a scalar in the mask (which Triton's
    # interpreter widens to int32)
    k_end = tl.minimum(K, hi * BLOCK_K)
    # each step's codes are loaded one step ahead (registers): their latency overlaps the previous step's FMAs
    codes = tl.load(w_ptrs + lo * BLOCK_K, mask=n_mask[:, None] & (lo * BLOCK_K + offs_k0 < k_end)[None, :], other=0)
    for step in range(lo, hi):
        offs_k = step * BLOCK_K + offs_k0
        nk = offs_k + BLOCK_K
        codes_next = tl.load(w_ptrs + (step + 1) * BLOCK_K, mask=n_mask[:, None] & (nk < k_end)[None, :], other=0)
        w = codes.to(tl.float32)  # [BLOCK_N, BLOCK_K] int8 codes, exact in fp32
        codes = codes_next
        p, s = _int8_row_products(w, x_ptr, nw_ptr, row0, M, stride_xm, offs_k, K, PRO)
        acc0 += p
        if PRO == 1:  # (no loop-carried zeros in the other kernels)
            sq0 += s
        if ROWS >= 2:
            p, s = _int8_row_products(w, x_ptr, nw_ptr, row0 + 1, M, stride_xm, offs_k, K, PRO)
            acc1 += p
            if PRO == 1:
                sq1 += s
        if ROWS >= 4:
            p, s = _int8_row_products(w, x_ptr, nw_ptr, row0 + 2, M, stride_xm, offs_k, K, PRO)
            acc2 += p
            if PRO == 1:
                sq2 += s
            p, s = _int8_row_products(w, x_ptr, nw_ptr, row0 + 3, M, stride_xm, offs_k, K, PRO)
            acc3 += p
            if PRO == 1:
                sq3 += s
    row_end(tl.sum(acc0, axis=1), tl.sum(sq0, axis=0), row0, offs_n, M, N, K, eps, pid_n, split, ws_ptr, ss_ptr,
             res_ptr, cs_ptr, out_ptr, stride_rm, stride_om, USE_WS, HAS_RES, True, PRO)  # fmt: skip
    if ROWS >= 2:
        row_end(tl.sum(acc1, axis=1), tl.sum(sq1, axis=0), row0 + 1, offs_n, M, N, K, eps, pid_n, split, ws_ptr,
                 ss_ptr, res_ptr, cs_ptr, out_ptr, stride_rm, stride_om, USE_WS, HAS_RES, True, PRO)  # fmt: skip
    if ROWS >= 4:
        row_end(tl.sum(acc2, axis=1), tl.sum(sq2, axis=0), row0 + 2, offs_n, M, N, K, eps, pid_n, split, ws_ptr,
                 ss_ptr, res_ptr, cs_ptr, out_ptr, stride_rm, stride_om, USE_WS, HAS_RES, True, PRO)  # fmt: skip
        row_end(tl.sum(acc3, axis=1), tl.sum(sq3, axis=0), row0 + 3, offs_n, M, N, K, eps, pid_n, split, ws_ptr,
                 ss_ptr, res_ptr, cs_ptr, out_ptr, stride_rm, stride_om, USE_WS, HAS_RES, True, PRO)  # fmt: skip
    if USE_WS:  # K split: the tile's last program sums the splits (quant_splits)
        finish_split_rows(cnt_ptr, tl.program_id(2) * tl.num_programs(0) + pid_n, splits, row0, offs_n, M, N,
                          ws_ptr, res_ptr, cs_ptr, out_ptr, stride_rm, stride_om, ss_ptr, pid_n, tl.num_programs(0),
                          K, eps, ROWS, HAS_RES, True, PRO == 1)  # fmt: skip


def quant_gemv(
    x: torch.Tensor,
    weight: NF4Weight | Int8Weight,
    residual: torch.Tensor | None,
    config: tuple[int, int, int, int, int],
    prologue: int = 0,
    norm_weight: torch.Tensor | None = None,
    eps: float = 0.0,
) -> torch.Tensor:
    """f(x) [M, K] (M <= GEMV_MAX_ROWS, last dim contiguous, the weight's dtype) @ W[N, K]^T (+ residual [M, N])
    -> [M, N] in the weight's dtype. `config` is one of NF4_GEMV_CONFIGS / INT8_GEMV_CONFIGS (ValueError for a
    config of the other kind or a bad shape). f = `prologue` (quant_splits.PROLOGUES;
    the INT8 byte GEMV only): the identity, RMSNorm with `norm_weight` [K] and `eps`, or SiLU gating of x [M, 2K]."""
    m, kx = x.shape
    n, k = weight.shape
    if kx != prologue_width(k, prologue) or not 1 <= m <= GEMV_MAX_ROWS or x.stride(1) != 1 or x.dtype != weight.dtype:
        raise ValueError(
            f"quant_gemv takes [1..{GEMV_MAX_ROWS}, {prologue_width(k, prologue)}] contiguous {weight.dtype} rows, "
            f"got {tuple(x.shape)} {x.dtype}"
        )
    check_prologue(k, prologue, norm_weight)
    if prologue and not fusable(isinstance(weight, Int8Weight), config):
        raise ValueError(f"{config} runs no prologue (the INT8 byte GEMV does)")
    if residual is not None and (residual.shape != (m, n) or residual.stride(1) != 1):
        raise ValueError(f"residual must be a [{m}, {n}] tensor with a contiguous last dim")
    block_n, block_k, splits, warps, _ = config
    if splits < 1 or block_n < 1 or block_k < 1:
        raise ValueError(f"bad GEMV config {config}")
    rows = rows_per_program(m)
    out = torch.empty((m, n), dtype=weight.dtype, device=x.device)
    use_ws = splits > 1
    ws = torch.empty((splits, m, n), dtype=torch.float32, device=x.device) if use_ws else out  # [S, M, N]
    res = residual if residual is not None else out
    grid = (triton.cdiv(n, block_n), splits, triton.cdiv(m, rows))
    # [split_counter_slots(N)] int32 arrival counts of the output tiles (not read without a split)
    counters = counters_for_tiles(weight, grid[0] * grid[2]) if use_ws else ws
    if isinstance(weight, NF4Weight):
        if config not in NF4_GEMV_CONFIGS:
            raise ValueError(f"{config} is not an NF4 GEMV config")
        blocks = block_k  # 64-value blocks per step
        _nf4_gemv_kernel[grid](
            x, weight.packed, weight.absmax_codes, weight.nested_absmax, weight.nested_code,
            weight.code, ws, res, out, counters,
            m, n, k, x.stride(0), weight.packed.stride(0), res.stride(0), out.stride(0), weight.nested_offset, splits,
            BLOCK_N=block_n, NB=blocks, ROWS=rows, USE_WS=use_ws, HAS_RES=residual is not None,
            num_warps=warps,
        )  # fmt: skip
    else:
        if config not in INT8_GEMV_CONFIGS:
            raise ValueError(f"{config} is not an Int8 GEMV config")
        norm = prologue == PROLOGUES["rmsnorm"] and use_ws  # [splits, M, N tiles] fp32 partial sums of squares
        ss = torch.empty((splits, m, grid[0]), dtype=torch.float32, device=x.device) if norm else ws
        _int8_gemv_kernel[grid](
            x, weight.codes, weight.col_scale, ws, res, out, counters, norm_weight if prologue == 1 else ws, ss,
            m, n, k, x.stride(0), weight.codes.stride(0), res.stride(0), out.stride(0), splits, eps,
            BLOCK_N=block_n, BLOCK_K=block_k, ROWS=rows, USE_WS=use_ws, HAS_RES=residual is not None,
            PRO=prologue, num_warps=warps,
        )  # fmt: skip
    return out
