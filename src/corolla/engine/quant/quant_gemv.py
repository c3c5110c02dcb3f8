"""The Triton dequantize-GEMV kernel for NF4 decode steps of a few rows (up to `GEMV_MAX_ROWS`), reading the NF4 layout
of `engine.quant.quant_weights` in place without the matrix units: out[M, N] = x[M, K] @ W[N, K]^T (+ residual).
INT8 rows run on the block kernel (quant_kernels) or the matrix-unit row GEMV (quant_int8_gemv).

Why not `tl.dot`: at one to a few rows a matrix instruction wastes 15/16 of its work and forces the decoded weight
tile through a shared-memory layout change; here each program streams a [BLOCK_N, bytes] tile of packed weight
rows with 16-byte loads, decodes it in registers and multiplies in fp32 on the CUDA cores (bound by the decode:
docs/decisions/0017).

NF4 decode: each nibble looked up in the 16-entry fp32 level table (64 bytes: one cache line, so a warp's lookups
are served in one L1 pass); the two nibbles are interleaved back into element order in registers (`tl.join`), each
64-value block is summed against x and scaled once by its decoded absmax (uint8 code -> nested code table *
second-level absmax + offset), accumulated in fp32. This serves NF4 weights kept in fp32 (and NF4 steps before tuning);
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

from corolla.engine.kernels.quant_splits import finish_row, finish_split_rows, rows_per_program
from corolla.engine.quant.quant_weights import NF4Weight, counters_for_tiles

GEMV_MAX_ROWS = 8  # decode steps of at most this many rows run here, larger ones on quant_kernels' tl.dot kernel

# (BLOCK_N, 64-value blocks per step, K splits, num_warps, 0); splits are a run-time argument
NF4_GEMV_CONFIGS: tuple[tuple[int, int, int, int, int], ...] = ((32, 2, 8, 4, 0),)
DEFAULT_NF4_CONFIG = NF4_GEMV_CONFIGS[0]  # before (or without) tuning


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
    finish_row(tl.sum(acc0, axis=1), row0, offs_n, M, N, split, ws_ptr, res_ptr, out_ptr, stride_rm, stride_om,
                USE_WS, HAS_RES)  # fmt: skip
    if ROWS >= 2:
        finish_row(tl.sum(acc1, axis=1), row0 + 1, offs_n, M, N, split, ws_ptr, res_ptr, out_ptr, stride_rm,
                    stride_om, USE_WS, HAS_RES)  # fmt: skip
    if ROWS >= 4:
        finish_row(tl.sum(acc2, axis=1), row0 + 2, offs_n, M, N, split, ws_ptr, res_ptr, out_ptr, stride_rm,
                    stride_om, USE_WS, HAS_RES)  # fmt: skip
        finish_row(tl.sum(acc3, axis=1), row0 + 3, offs_n, M, N, split, ws_ptr, res_ptr, out_ptr, stride_rm,
                    stride_om, USE_WS, HAS_RES)  # fmt: skip
    if USE_WS:  # K split: the tile's last program sums the splits (quant_splits)
        finish_split_rows(cnt_ptr, tl.program_id(2) * tl.num_programs(0) + pid_n, splits, row0, offs_n, M, N,
                          ws_ptr, res_ptr, out_ptr, stride_rm, stride_om, ROWS, HAS_RES)  # fmt: skip


def quant_gemv(
    x: torch.Tensor, weight: NF4Weight, residual: torch.Tensor | None, config: tuple[int, int, int, int, int]
) -> torch.Tensor:
    """x [M, K] (M <= GEMV_MAX_ROWS, last dim contiguous, the weight's dtype) @ W[N, K]^T (+ residual [M, N]) -> [M,
    N] in the weight's dtype. `config` is one of NF4_GEMV_CONFIGS (ValueError for another config, a weight not NF4
    or a bad shape)."""
    if not isinstance(weight, NF4Weight):
        raise ValueError(f"quant_gemv takes NF4 weights, not {type(weight).__name__}")
    m, kx = x.shape
    n, k = weight.shape
    if kx != k or not 1 <= m <= GEMV_MAX_ROWS or x.stride(1) != 1 or x.dtype != weight.dtype:
        raise ValueError(
            f"quant_gemv takes [1..{GEMV_MAX_ROWS}, {k}] contiguous {weight.dtype} rows, got {tuple(x.shape)} {x.dtype}"
        )
    if residual is not None and (residual.shape != (m, n) or residual.stride(1) != 1):
        raise ValueError(f"residual must be a [{m}, {n}] tensor with a contiguous last dim")
    if config not in NF4_GEMV_CONFIGS:
        raise ValueError(f"{config} is not an NF4 GEMV config")
    block_n, blocks, splits, warps, _ = config  # blocks: 64-value blocks per step
    rows = rows_per_program(m)
    out = torch.empty((m, n), dtype=weight.dtype, device=x.device)
    use_ws = splits > 1
    ws = torch.empty((splits, m, n), dtype=torch.float32, device=x.device) if use_ws else out  # [S, M, N]
    res = residual if residual is not None else out
    grid = (triton.cdiv(n, block_n), splits, triton.cdiv(m, rows))
    # [split_counter_slots(N)] int32 arrival counts of the output tiles (not read without a split)
    counters = counters_for_tiles(weight, grid[0] * grid[2]) if use_ws else ws
    _nf4_gemv_kernel[grid](
        x, weight.packed, weight.absmax_codes, weight.nested_absmax, weight.nested_code,
        weight.code, ws, res, out, counters,
        m, n, k, x.stride(0), weight.packed.stride(0), res.stride(0), out.stride(0), weight.nested_offset, splits,
        BLOCK_N=block_n, NB=blocks, ROWS=rows, USE_WS=use_ws, HAS_RES=residual is not None,
        num_warps=warps,
    )  # fmt: skip
    return out
