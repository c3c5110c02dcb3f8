"""Triton NF4 dequantize-tile GEMM for merged decode steps (more than `quant_gemv.GEMV_MAX_ROWS` rows, at most
`quant_kernels.QUANT_KERNEL_MAX_ROWS`): out[M, N] = x[M, K] @ W[N, K]^T (+ residual), W read in
bitsandbytes' NF4 layout in place.

Each program streams a [BLOCK_N, BLOCK_K / 2] tile of packed bytes per step with 16-byte loads, decodes it once
into the dequantized [BLOCK_N, BLOCK_K] tile in the compute dtype (level from the 16-entry fp32 table times the
block's decoded absmax, rounded once: the values of the reference dequantizer) and multiplies it with up to four
16-row tiles of x on the matrix units (one `tl.dot` of depth BLOCK_K per row tile and step). Configs with decode 1
run the same tiling with `quant_prmt`'s register lookup instead of the table (quant_prmt_kernels). The alternative in
`quant_kernels` runs two depth-32 dots per 64-value block and scales after them; `DecodeOps.tune_quantized` times
both and keeps the faster per weight shape.

Batch invariance: every 16-row tile of the output is computed by the same instruction sequence in the same K
order whatever the number of tiles a program carries, and a split of K is summed in split order by
`quant_gemv`'s second kernel: a row's output does not depend on the other rows of the step. CUDA-graph safe.
Importing fails without Triton."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from corolla.engine import quant_prmt_kernels
from corolla.engine.quant import NF4_BLOCK_VALUES, NF4Weight
from corolla.engine.quant_gemv import _split_sum_kernel

TILE_M = 16
MAX_TILES = 4  # 16-row tiles one program multiplies against its decoded weight tile

# (BLOCK_N, BLOCK_K values, K splits, num_warps, decode): decode 0 = levels from the fp32 table in memory (this
# module's kernel), 1 = quant_prmt's register lookup (quant_prmt_kernels' tile kernel); 3 pipeline stages. On the
# H100 the register lookup was 3.9-4.2x faster than the table at 64 rows on every Llama-3-8B projection; 2 or 4
# splits of [64, 128] tiles won every shape (8 splits, 32-wide tiles and [128, 128] tiles with 8 warps never did:
# benchmarks/results/quant-nvidia-h100-80gb-hbm3-20261126-2015.json and -2041.json). One table config is kept as
# the baseline the bench reports.
NF4_TILE_CONFIGS: tuple[tuple[int, int, int, int, int], ...] = (
    (64, 128, 2, 4, 0),
    (64, 128, 2, 4, 1),
    (64, 128, 4, 4, 1),
)
NUM_STAGES = 3


def tiles_per_program(m: int) -> int:
    return 1 if m <= TILE_M else 2 if m <= 2 * TILE_M else MAX_TILES


@triton.jit
def _tile_dot(x_ptr, offs_m, M, stride_xm, offs_k, K, wt, acc):
    # acc [16, BLOCK_N] += x[offs_m, offs_k] [16, BLOCK_K] @ wt [BLOCK_K, BLOCK_N]
    x = tl.load(
        x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
        mask=(offs_m < M)[:, None] & (offs_k < K)[None, :],
        other=0.0,
    )
    return tl.dot(x, wt, acc)


@triton.jit
def _tile_store(acc, offs_m, offs_n, M, N, split, ws_ptr, res_ptr, out_ptr, stride_rm, stride_om,
                USE_WS: tl.constexpr, HAS_RES: tl.constexpr):  # fmt: skip
    mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    if USE_WS:
        tl.store(ws_ptr + (split * M + offs_m[:, None]) * N + offs_n[None, :], acc, mask=mask)
    else:
        if HAS_RES:
            acc += tl.load(res_ptr + offs_m[:, None] * stride_rm + offs_n[None, :], mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _nf4_tile_gemm_kernel(
    x_ptr,
    q_ptr,
    aq_ptr,
    na_ptr,
    nc_ptr,
    code_ptr,
    ws_ptr,
    res_ptr,
    out_ptr,
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
    BLOCK_K: tl.constexpr,
    TILES: tl.constexpr,
    USE_WS: tl.constexpr,
    HAS_RES: tl.constexpr,
):
    # program (row group x n tile, split): TILES 16-row tiles of x against W[n tile, k-range of the split]
    pid = tl.program_id(0)
    split = tl.program_id(1)
    num_m = tl.cdiv(M, 16 * TILES)
    pid_m = pid % num_m  # the row groups of one n tile run next to each other (their weight bytes hit L2)
    pid_n = pid // num_m
    NB: tl.constexpr = BLOCK_K // 64  # absmax blocks per step
    BB: tl.constexpr = BLOCK_K // 2  # packed bytes per row per step
    dt = x_ptr.dtype.element_ty
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_bb = tl.arange(0, BB)
    offs_nb = tl.arange(0, NB)
    offs_m0 = pid_m * 16 * TILES + tl.arange(0, 16)
    kb = K // 64
    row_bytes = K // 2
    steps = tl.cdiv(kb, NB)
    per_split = tl.cdiv(steps, splits)
    acc0 = tl.zeros([16, BLOCK_N], dtype=tl.float32)
    acc1 = tl.zeros([16, BLOCK_N], dtype=tl.float32)
    acc2 = tl.zeros([16, BLOCK_N], dtype=tl.float32)
    acc3 = tl.zeros([16, BLOCK_N], dtype=tl.float32)
    for step in range(split * per_split, tl.minimum((split + 1) * per_split, steps)):
        b0 = step * NB
        cols = b0 * 32 + offs_bb  # [BB] byte columns
        byte = tl.load(
            q_ptr + offs_n[:, None] * stride_qn + cols[None, :],
            mask=n_mask[:, None] & (cols < row_bytes)[None, :],
            other=0,
        )  # [BLOCK_N, BB] uint8
        hi = tl.load(code_ptr + (byte >> 4).to(tl.int32))  # [BLOCK_N, BB] fp32 levels
        lo = tl.load(code_ptr + (byte & 15).to(tl.int32))
        levels = tl.reshape(tl.join(hi, lo), [BLOCK_N, NB, 64])  # element order
        gb = offs_n[:, None] * kb + b0 + offs_nb[None, :]  # [BLOCK_N, NB]
        smask = n_mask[:, None] & ((b0 + offs_nb) < kb)[None, :]
        aq = tl.load(aq_ptr + gb, mask=smask, other=0).to(tl.int32)
        scale = tl.load(nc_ptr + aq) * tl.load(na_ptr + gb // 256, mask=smask, other=0.0) + offset  # [BLOCK_N, NB]
        wt = tl.trans(tl.reshape(levels * scale[:, :, None], [BLOCK_N, BLOCK_K]).to(dt))  # [BLOCK_K, BLOCK_N]
        offs_k = b0 * 64 + tl.arange(0, BLOCK_K)
        acc0 = _tile_dot(x_ptr, offs_m0, M, stride_xm, offs_k, K, wt, acc0)
        if TILES >= 2:
            acc1 = _tile_dot(x_ptr, offs_m0 + 16, M, stride_xm, offs_k, K, wt, acc1)
        if TILES >= 4:
            acc2 = _tile_dot(x_ptr, offs_m0 + 32, M, stride_xm, offs_k, K, wt, acc2)
            acc3 = _tile_dot(x_ptr, offs_m0 + 48, M, stride_xm, offs_k, K, wt, acc3)
    _tile_store(acc0, offs_m0, offs_n, M, N, split, ws_ptr, res_ptr, out_ptr, stride_rm, stride_om, USE_WS, HAS_RES)
    if TILES >= 2:
        _tile_store(acc1, offs_m0 + 16, offs_n, M, N, split, ws_ptr, res_ptr, out_ptr, stride_rm, stride_om,
                    USE_WS, HAS_RES)  # fmt: skip
    if TILES >= 4:
        _tile_store(acc2, offs_m0 + 32, offs_n, M, N, split, ws_ptr, res_ptr, out_ptr, stride_rm, stride_om,
                    USE_WS, HAS_RES)  # fmt: skip
        _tile_store(acc3, offs_m0 + 48, offs_n, M, N, split, ws_ptr, res_ptr, out_ptr, stride_rm, stride_om,
                    USE_WS, HAS_RES)  # fmt: skip


def nf4_tile_matmul(
    x: torch.Tensor, weight: NF4Weight, residual: torch.Tensor | None, config: tuple[int, int, int, int, int]
) -> torch.Tensor:
    """x [M, K] (M <= 16 * MAX_TILES * any row groups, last dim contiguous, the weight's dtype) @ W[N, K]^T
    (+ residual [M, N]) -> [M, N] in the weight's dtype; ValueError for a bad shape or config."""
    m, k = x.shape
    n, wk = weight.shape
    if wk != k or m < 1 or x.stride(1) != 1 or x.dtype != weight.dtype:
        raise ValueError(f"nf4_tile_matmul takes [M, {wk}] contiguous {weight.dtype} rows, got {tuple(x.shape)}")
    if residual is not None and (residual.shape != (m, n) or residual.stride(1) != 1):
        raise ValueError(f"residual must be a [{m}, {n}] tensor with a contiguous last dim")
    if config not in NF4_TILE_CONFIGS:
        raise ValueError(f"{config} is not an NF4 tile config")
    block_n, block_k, splits, warps, decode = config
    if block_k % NF4_BLOCK_VALUES:
        raise ValueError(f"BLOCK_K must be a multiple of {NF4_BLOCK_VALUES}")
    tiles = tiles_per_program(m)
    if decode == 1:
        return quant_prmt_kernels.nf4_prmt_tile_matmul(x, weight, residual, block_n, block_k, splits, warps, tiles)
    out = torch.empty((m, n), dtype=weight.dtype, device=x.device)
    use_ws = splits > 1
    ws = torch.empty((splits, m, n), dtype=torch.float32, device=x.device) if use_ws else out  # [S, M, N]
    res = residual if residual is not None else out
    grid = (triton.cdiv(m, TILE_M * tiles) * triton.cdiv(n, block_n), splits)
    _nf4_tile_gemm_kernel[grid](
        x, weight.packed, weight.absmax_codes, weight.nested_absmax, weight.nested_code, weight.code, ws, res, out,
        m, n, k, x.stride(0), weight.packed.stride(0), res.stride(0), out.stride(0), weight.nested_offset, splits,
        BLOCK_N=block_n, BLOCK_K=block_k, TILES=tiles, USE_WS=use_ws, HAS_RES=residual is not None and not use_ws,
        num_warps=warps, num_stages=NUM_STAGES,
    )  # fmt: skip
    if use_ws:
        block = 1024
        _split_sum_kernel[(m, triton.cdiv(n, block))](
            ws, res, ws, out, m, n, res.stride(0), out.stride(0), splits,
            HAS_RES=residual is not None, HAS_SCALE=False, BLOCK=block,
        )  # fmt: skip
    return out
