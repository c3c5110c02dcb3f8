"""The Triton NF4 dequantize-GEMV that decodes with the register lookup of `quant_prmt` (byte permutes, no table
loads), for one-row decode steps where the tuner times it faster than `quant_stream`'s streaming GEMV or its fused
norm / SiLU prologue pays (and up to `quant_gemv.GEMV_MAX_ROWS` rows where no matrix-unit config is tuned:
`quant_mma` serves NF4 steps of 2 to 64 rows). It reads bitsandbytes' NF4 layout in place, as 32-bit words (4 bytes,
8 codes; the weight's bytes per row are a multiple of 32, so every row starts word-aligned).

Each program streams [BLOCK_N, 8] words per step (one 64-value block per row, 16-byte loads), decodes them into
[BLOCK_N, 8, 8] fp32 levels in element order, multiplies each row of x (read as [8, 8] per block, in the same
order) and keeps per-word partial sums [BLOCK_N, 8] in fp32, scaled by the block's decoded absmax; the words are
summed once at the end in a fixed order; it may run RMSNorm or SiLU gating on x as it loads it (`quant_splits`
prologues).

Batch invariance (as in quant_gemv): a row's output is computed by the same instructions in the same order whatever
the other rows are (per-row accumulators), and a split of K is summed in split order by the last program to finish
an output tile (an arrival count per tile in `NF4Weight.split_counters()`, reset by that program, `quant_splits`:
one launch per projection instead of two). CUDA-graph safe. The table words are kernel arguments
(`NF4Weight.lut_words`): any 16-level code table works. Importing fails without Triton; the inline PTX runs on
NVIDIA GPUs only (not under Triton's CPU interpreter): `quant_prmt.emulate_decode` is its CPU twin."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from corolla.engine.quant import NF4Weight, counters_for_tiles
from corolla.engine.quant_gemv import row_end, rows_per_program
from corolla.engine.quant_prmt import DECODE_CONSTRAINTS, decode_ptx
from corolla.engine.quant_splits import (
    PROLOGUES,
    check_prologue,
    finish_split_rows,
    prologue_width,
    prologue_x,
    row_mask,
)

_PTX = tl.constexpr(decode_ptx())
_CONSTRAINTS = tl.constexpr(DECODE_CONSTRAINTS)


@triton.jit
def _levels(words, t0, t1, t2, t3, t4, t5, t6, t7):
    # words [B, C] int32 -> [B, C, 8] fp32 levels, element 8c + t of the row at [.., c, t]
    v0, v1, v2, v3, v4, v5, v6, v7 = tl.inline_asm_elementwise(
        _PTX, _CONSTRAINTS, [words, t0, t1, t2, t3, t4, t5, t6, t7],
        dtype=(tl.float32,) * 8, is_pure=True, pack=1,
    )  # fmt: skip
    even = tl.join(tl.join(v0, v4), tl.join(v2, v6))  # [B, C, 2, 2]: t = 4 a + 2 b
    odd = tl.join(tl.join(v1, v5), tl.join(v3, v7))
    return tl.reshape(tl.join(even, odd), [words.shape[0], words.shape[1], 8])


@triton.jit
def _block_scale(aq_ptrs, nc_ptr, na_ptrs, offset):
    # the decoded absmax of each block: nested_code[aq] * nested_absmax + offset. Loaded in inline PTX (read-only,
    # in bounds: callers clamp the rows) so the scales take the layout of their use; as tl.load anchors Triton gave
    # them another layout and converted the accumulators through shared memory with barriers every step.
    return tl.inline_asm_elementwise(
        """{
        .reg .b32 %c; .reg .b16 %c16; .reg .b64 %a; .reg .f32 %e, %g;
        ld.global.nc.u8 %c16, [$1];
        cvt.u32.u16 %c, %c16;
        mad.wide.u32 %a, %c, 4, $2;
        ld.global.nc.f32 %e, [%a];
        ld.global.nc.f32 %g, [$3];
        fma.rn.f32 $0, %e, %g, $4;
        }""",
        "=r,l,l,l,r", [aq_ptrs.to(tl.int64), nc_ptr.to(tl.int64), na_ptrs.to(tl.int64), offset],
        dtype=tl.float32, is_pure=True, pack=1,
    )  # fmt: skip


@triton.jit
def _row_word_sums(w, x_ptr, nw_ptr, row, M, stride_xm, k0, K, C: tl.constexpr, PRO: tl.constexpr):
    # w [B, C, 8] fp32 levels of values k0 + 8c + t; f(x)[row] (prologue PRO, quant_splits) -> [B, C] per-word dot
    # products and [C, 8] squares of x (RMSNorm's statistics; zeros otherwise)
    offs = k0 + tl.arange(0, C)[:, None] * 8 + tl.arange(0, 8)[None, :]  # [C, 8]
    xr, sq = prologue_x(x_ptr, nw_ptr, row, M, stride_xm, offs, K, PRO)
    return tl.sum(w * xr[None, :, :], axis=2), sq


@triton.jit
def _nf4_prmt_gemv_kernel(
    x_ptr, q_ptr, aq_ptr, na_ptr, nc_ptr, ws_ptr, res_ptr, out_ptr, cnt_ptr, nw_ptr, ss_ptr,
    M, N, K, stride_xm, stride_qn, stride_rm, stride_om, offset, splits, eps,
    t0, t1, t2, t3, t4, t5, t6, t7,
    BLOCK_N: tl.constexpr, ROWS: tl.constexpr, USE_WS: tl.constexpr, HAS_RES: tl.constexpr, PRO: tl.constexpr,
):  # fmt: skip
    # program (n tile, split, row group); q_ptr: the packed bytes as int32 words, stride_qn in words per row.
    # PRO: the prologue (RMSNorm's gain nw [K] and statistics ss, or SiLU gating of x [M, 2K]; quant_splits).
    # USE_WS (K split): each program stores its partial sums; the last program of an (n tile, row group) to finish
    # (counted in cnt_ptr) sums the splits in split order and writes the output (no second kernel).
    # Step = one 64-value absmax block: 8 words per row; block b of row n has absmax code aq[n * K / 64 + b].
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    row0 = tl.program_id(2) * ROWS
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_c = tl.arange(0, 8)
    kb = K // 64
    per_split = tl.cdiv(kb, splits)
    # [BLOCK_N, 8] per-word sums, made as a reduction of a 3-D zero so they start in the layout the loop adds in
    # (a plain 2-D zero made Triton convert the accumulator through shared memory every step)
    acc0 = tl.sum(tl.zeros([BLOCK_N, 8, 8], dtype=tl.float32), axis=2)
    acc1 = tl.sum(tl.zeros([BLOCK_N, 8, 8], dtype=tl.float32), axis=2)
    acc2 = tl.sum(tl.zeros([BLOCK_N, 8, 8], dtype=tl.float32), axis=2)
    acc3 = tl.sum(tl.zeros([BLOCK_N, 8, 8], dtype=tl.float32), axis=2)
    sq0 = tl.zeros([8, 8], dtype=tl.float32)  # RMSNorm: x^2 of each row over the split's K range
    sq1 = tl.zeros([8, 8], dtype=tl.float32)
    sq2 = tl.zeros([8, 8], dtype=tl.float32)
    sq3 = tl.zeros([8, 8], dtype=tl.float32)
    lo = split * per_split
    hi = tl.minimum(lo + per_split, kb)
    w_ptrs = q_ptr + offs_n[:, None] * stride_qn + offs_c[None, :]  # [BLOCK_N, 8] words of block 0
    row_blocks = tl.minimum(offs_n, N - 1)[:, None] * kb  # [BLOCK_N, 1] first absmax block of each row (clamped)
    # each step's words and scales are loaded one step ahead (registers), so their latency (the scale's two
    # dependent loads included) overlaps the previous step's decode
    # (masks as one compare: Triton's interpreter widens a tensor mask and-ed with a scalar condition to int32)
    words = tl.load(w_ptrs + lo * 8, mask=row_mask(offs_n, N, lo, hi)[:, None], other=0)
    gb = row_blocks + tl.minimum(lo, kb - 1)
    scale = _block_scale(aq_ptr + gb, nc_ptr, na_ptr + gb // 256, offset)
    for b in range(lo, hi):
        words_next = tl.load(w_ptrs + (b + 1) * 8, mask=row_mask(offs_n, N, b + 1, hi)[:, None], other=0)
        gb = row_blocks + tl.minimum(b + 1, kb - 1)
        scale_next = _block_scale(aq_ptr + gb, nc_ptr, na_ptr + gb // 256, offset)
        w = _levels(words, t0, t1, t2, t3, t4, t5, t6, t7)  # [BLOCK_N, 8, 8]
        k0 = b * 64
        p, q = _row_word_sums(w, x_ptr, nw_ptr, row0, M, stride_xm, k0, K, 8, PRO)
        acc0 += p * scale
        if PRO == 1:  # (no loop-carried zeros in the other kernels)
            sq0 += q
        if ROWS >= 2:
            p, q = _row_word_sums(w, x_ptr, nw_ptr, row0 + 1, M, stride_xm, k0, K, 8, PRO)
            acc1 += p * scale
            if PRO == 1:
                sq1 += q
        if ROWS >= 4:
            p, q = _row_word_sums(w, x_ptr, nw_ptr, row0 + 2, M, stride_xm, k0, K, 8, PRO)
            acc2 += p * scale
            if PRO == 1:
                sq2 += q
            p, q = _row_word_sums(w, x_ptr, nw_ptr, row0 + 3, M, stride_xm, k0, K, 8, PRO)
            acc3 += p * scale
            if PRO == 1:
                sq3 += q
        words = words_next
        scale = scale_next
    row_end(tl.sum(acc0, axis=1), tl.sum(tl.sum(sq0, axis=1), axis=0), row0, offs_n, M, N, K, eps, pid_n, split,
             ws_ptr, ss_ptr, res_ptr, ws_ptr, out_ptr, stride_rm, stride_om, USE_WS, HAS_RES, False, PRO)  # fmt: skip
    if ROWS >= 2:
        row_end(tl.sum(acc1, axis=1), tl.sum(tl.sum(sq1, axis=1), axis=0), row0 + 1, offs_n, M, N, K, eps, pid_n,
                 split, ws_ptr, ss_ptr, res_ptr, ws_ptr, out_ptr, stride_rm, stride_om, USE_WS, HAS_RES, False,
                 PRO)  # fmt: skip
    if ROWS >= 4:
        row_end(tl.sum(acc2, axis=1), tl.sum(tl.sum(sq2, axis=1), axis=0), row0 + 2, offs_n, M, N, K, eps, pid_n,
                 split, ws_ptr, ss_ptr, res_ptr, ws_ptr, out_ptr, stride_rm, stride_om, USE_WS, HAS_RES, False,
                 PRO)  # fmt: skip
        row_end(tl.sum(acc3, axis=1), tl.sum(tl.sum(sq3, axis=1), axis=0), row0 + 3, offs_n, M, N, K, eps, pid_n,
                 split, ws_ptr, ss_ptr, res_ptr, ws_ptr, out_ptr, stride_rm, stride_om, USE_WS, HAS_RES, False,
                 PRO)  # fmt: skip
    if USE_WS:  # K split: the tile's last program sums the splits (quant_splits)
        finish_split_rows(cnt_ptr, tl.program_id(2) * tl.num_programs(0) + pid_n, splits, row0, offs_n, M, N,
                          ws_ptr, res_ptr, ws_ptr, out_ptr, stride_rm, stride_om, ss_ptr, pid_n, tl.num_programs(0),
                          K, eps, ROWS, HAS_RES, False, PRO == 1)  # fmt: skip


def _words(weight: NF4Weight) -> torch.Tensor:
    # [N, K / 8] int32 view of the packed bytes (rows of K / 2 bytes, a multiple of 32)
    return weight.packed.view(torch.int32)


def _check(x: torch.Tensor, weight: NF4Weight, residual: torch.Tensor | None, name: str) -> None:
    m, k = x.shape
    n, wk = weight.shape
    if wk != k or m < 1 or x.stride(1) != 1 or x.dtype != weight.dtype or weight.dtype == torch.float32:
        raise ValueError(
            f"{name} takes [M, {wk}] contiguous 16-bit {weight.dtype} rows, got {tuple(x.shape)} {x.dtype}"
        )
    if weight.packed.stride(1) != 1 or weight.packed.stride(0) % 4 or weight.packed.data_ptr() % 4:
        raise ValueError(f"{name} reads the packed bytes as 32-bit words: rows must be contiguous and 4-byte aligned")
    if residual is not None and (residual.shape != (m, n) or residual.stride(1) != 1):
        raise ValueError(f"residual must be a [{m}, {n}] tensor with a contiguous last dim")


def nf4_prmt_gemv(
    x: torch.Tensor, weight: NF4Weight, residual: torch.Tensor | None, block_n: int, splits: int, warps: int, *,
    prologue: int = 0, norm_weight: torch.Tensor | None = None, eps: float = 0.0,
) -> torch.Tensor:  # fmt: skip
    """f(x) [M, K] (M <= quant_gemv.GEMV_MAX_ROWS) @ W[N, K]^T (+ residual [M, N]) -> [M, N] in the weight's dtype
    (bf16 or fp16), f = `prologue` (quant_splits.PROLOGUES: identity, RMSNorm with `norm_weight` and `eps`, SiLU
    gating of x [M, 2K]); ValueError for a bad shape or tiling."""
    n, k = weight.shape
    _check(x[:, :k], weight, residual, "nf4_prmt_gemv")
    if x.shape[1] != prologue_width(k, prologue):
        raise ValueError(f"nf4_prmt_gemv takes [M, {prologue_width(k, prologue)}] rows, got {tuple(x.shape)}")
    check_prologue(k, prologue, norm_weight)
    m = x.shape[0]
    if block_n < 16 or splits < 1 or warps < 1:
        raise ValueError(f"bad NF4 register-lookup GEMV tiling {(block_n, splits, warps)}")
    rows = rows_per_program(m)
    out = torch.empty((m, n), dtype=weight.dtype, device=x.device)
    use_ws = splits > 1
    ws = torch.empty((splits, m, n), dtype=torch.float32, device=x.device) if use_ws else out  # [S, M, N]
    res = residual if residual is not None else out
    words = _words(weight)
    grid = (triton.cdiv(n, block_n), splits, triton.cdiv(m, rows))
    # [split_counter_slots(N)] int32 arrival counts of the output tiles (not read without a split)
    counters = counters_for_tiles(weight, grid[0] * grid[2]) if use_ws else words
    norm = prologue == PROLOGUES["rmsnorm"] and use_ws  # [splits, M, N tiles] fp32 partial sums of squares
    ss = torch.empty((splits, m, grid[0]), dtype=torch.float32, device=x.device) if norm else ws
    _nf4_prmt_gemv_kernel[grid](
        x, words, weight.absmax_codes, weight.nested_absmax, weight.nested_code, ws, res, out, counters,
        norm_weight if prologue == PROLOGUES["rmsnorm"] else ws, ss,
        m, n, k, x.stride(0), words.stride(0), res.stride(0), out.stride(0), weight.nested_offset, splits, eps,
        *weight.lut_words,
        BLOCK_N=block_n, ROWS=rows, USE_WS=use_ws, HAS_RES=residual is not None, PRO=prologue, num_warps=warps,
    )  # fmt: skip
    return out
