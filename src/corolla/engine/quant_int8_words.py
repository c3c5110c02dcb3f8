"""Triton INT8 dequantize-GEMV reading LLM.int8 codes as 32-bit words (4 codes each) and converting them to fp32
with byte permutes instead of `I2F`: out[M, N] = (x[M, K] @ codes[N, K]^T) * row_absmax / 127 (+ residual), for
decode steps of up to `quant_gemv.GEMV_MAX_ROWS` rows (config field 4 = 1 in `quant_gemv.INT8_GEMV_CONFIGS`).

Why: the byte kernel of quant_gemv converts each code with `I2F`, which Hopper issues at 16 per cycle per SM, about
the rate the codes arrive at from memory (benchmarks/results/quant-nvidia-h100-80gb-hbm3-20261126-2015: 1.12-2.04x
the floor). Here a code c becomes the low mantissa byte of the fp32 2^23 (`prmt` of c ^ 0x80 = c + 128 into
0x4B0000xx) and one exact fp32 subtraction of 2^23 + 128 gives c: integer permutes (64 per cycle) and an FADD.

Each program streams [BLOCK_N, BLOCK_K / 4] words per step (16-byte loads, the next step's words loaded ahead),
keeps per-word fp32 partial sums per row and sums them once at the end in a fixed order; a split of K is summed in
split order by the last program of each output tile to finish (`quant_splits`, no second kernel): a row's output
does not depend on the other rows. CUDA-graph safe.
Importing fails without Triton; the inline PTX runs on NVIDIA GPUs only."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from corolla.engine.quant import Int8Weight, counters_for_tiles
from corolla.engine.quant_splits import (
    finish_row,
    finish_split_rows,
    launch_options,
    programmatic_launch,
    rows_per_program,
    wait_for_producer,
)


@triton.jit
def _codes_f32(words):
    # words [B, C] int32 (4 int8 codes, code 4c + t in byte t) -> [B, C, 4] fp32 codes in element order
    v0, v1, v2, v3 = tl.inline_asm_elementwise(
        """{
        .reg .b32 %w, %k, %f;
        xor.b32 %w, $4, 0x80808080;
        mov.b32 %k, 0x4B000000;
        prmt.b32 %f, %w, %k, 0x7540;
        sub.f32 $0, %f, 0f4B000080;
        prmt.b32 %f, %w, %k, 0x7541;
        sub.f32 $1, %f, 0f4B000080;
        prmt.b32 %f, %w, %k, 0x7542;
        sub.f32 $2, %f, 0f4B000080;
        prmt.b32 %f, %w, %k, 0x7543;
        sub.f32 $3, %f, 0f4B000080;
        }""",
        "=r,=r,=r,=r,r", [words], dtype=(tl.float32,) * 4, is_pure=True, pack=1,
    )  # fmt: skip
    return tl.reshape(tl.join(tl.join(v0, v2), tl.join(v1, v3)), [words.shape[0], words.shape[1], 4])


@triton.jit
def _row_word_sums(w, x_ptr, row, M, stride_xm, k0, K, C: tl.constexpr):
    # w [B, C, 4] fp32 codes of values k0 + 4c + t; x[row] -> [B, C] per-word dot products
    offs = k0 + tl.arange(0, C)[:, None] * 4 + tl.arange(0, 4)[None, :]  # [C, 4]
    xr = tl.load(x_ptr + row * stride_xm + offs, mask=(offs < K) & (row < M), other=0.0).to(tl.float32)
    return tl.sum(w * xr[None, :, :], axis=2)


@triton.jit
def _int8_words_gemv_kernel(
    x_ptr, q_ptr, cs_ptr, ws_ptr, res_ptr, out_ptr, cnt_ptr,
    M, N, K, stride_xm, stride_qn, stride_rm, stride_om, splits,
    BLOCK_N: tl.constexpr, C: tl.constexpr, ROWS: tl.constexpr, USE_WS: tl.constexpr, HAS_RES: tl.constexpr,
    USE_PDL: tl.constexpr,
):  # fmt: skip
    # program (n tile, split, row group); q_ptr: the codes as int32 words, stride_qn in words per row; step = C
    # words (4 C values) per row
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    row0 = tl.program_id(2) * ROWS
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_c = tl.arange(0, C)
    kw = K // 4
    steps = tl.cdiv(kw, C)
    per_split = tl.cdiv(steps, splits)
    lo = split * per_split
    hi = tl.minimum(lo + per_split, steps)
    w_ptrs = q_ptr + offs_n[:, None] * stride_qn + offs_c[None, :]  # [BLOCK_N, C]
    # [BLOCK_N, C] per-word sums, made as a reduction of a 3-D zero so they start in the layout the loop adds in
    acc0 = tl.sum(tl.zeros([BLOCK_N, C, 4], dtype=tl.float32), axis=2)
    acc1 = tl.sum(tl.zeros([BLOCK_N, C, 4], dtype=tl.float32), axis=2)
    acc2 = tl.sum(tl.zeros([BLOCK_N, C, 4], dtype=tl.float32), axis=2)
    acc3 = tl.sum(tl.zeros([BLOCK_N, C, 4], dtype=tl.float32), axis=2)
    words = tl.load(w_ptrs + lo * C, mask=n_mask[:, None] & (lo * C + offs_c < kw)[None, :] & (lo < hi), other=0)
    wait_for_producer(USE_PDL)  # the first words are in flight; x and the residual come from the previous kernel
    for step in range(lo, hi):
        nc = (step + 1) * C + offs_c
        words_next = tl.load(w_ptrs + (step + 1) * C, mask=n_mask[:, None] & (nc < kw)[None, :] & (step + 1 < hi),
                             other=0)  # fmt: skip
        w = _codes_f32(words)  # [BLOCK_N, C, 4]
        k0 = step * C * 4
        acc0 += _row_word_sums(w, x_ptr, row0, M, stride_xm, k0, K, C)
        if ROWS >= 2:
            acc1 += _row_word_sums(w, x_ptr, row0 + 1, M, stride_xm, k0, K, C)
        if ROWS >= 4:
            acc2 += _row_word_sums(w, x_ptr, row0 + 2, M, stride_xm, k0, K, C)
            acc3 += _row_word_sums(w, x_ptr, row0 + 3, M, stride_xm, k0, K, C)
        words = words_next
    finish_row(tl.sum(acc0, axis=1), row0, offs_n, M, N, split, ws_ptr, res_ptr, cs_ptr, out_ptr, stride_rm,
                stride_om, USE_WS, HAS_RES, True)  # fmt: skip
    if ROWS >= 2:
        finish_row(tl.sum(acc1, axis=1), row0 + 1, offs_n, M, N, split, ws_ptr, res_ptr, cs_ptr, out_ptr,
                    stride_rm, stride_om, USE_WS, HAS_RES, True)  # fmt: skip
    if ROWS >= 4:
        finish_row(tl.sum(acc2, axis=1), row0 + 2, offs_n, M, N, split, ws_ptr, res_ptr, cs_ptr, out_ptr,
                    stride_rm, stride_om, USE_WS, HAS_RES, True)  # fmt: skip
        finish_row(tl.sum(acc3, axis=1), row0 + 3, offs_n, M, N, split, ws_ptr, res_ptr, cs_ptr, out_ptr,
                    stride_rm, stride_om, USE_WS, HAS_RES, True)  # fmt: skip
    if USE_WS:  # K split: the tile's last program sums the splits (quant_splits)
        finish_split_rows(cnt_ptr, tl.program_id(2) * tl.num_programs(0) + pid_n, splits, row0, offs_n, M, N,
                          ws_ptr, res_ptr, cs_ptr, out_ptr, stride_rm, stride_om, ws_ptr, 0, 1, K,
                          0.0, ROWS, HAS_RES, True, False)  # fmt: skip


def int8_words_gemv(
    x: torch.Tensor, weight: Int8Weight, residual: torch.Tensor | None, block_n: int, block_k: int, splits: int,
    warps: int,
) -> torch.Tensor:  # fmt: skip
    """x [M, K] (M <= quant_gemv.GEMV_MAX_ROWS, the weight's dtype) @ W[N, K]^T (+ residual [M, N]) -> [M, N];
    ValueError for a bad shape, a K or row layout that is not whole aligned words, or a bad tiling."""
    m, k = x.shape
    n, wk = weight.shape
    if wk != k or m < 1 or x.stride(1) != 1 or x.dtype != weight.dtype:
        raise ValueError(f"int8_words_gemv takes [M, {wk}] contiguous {weight.dtype} rows, got {tuple(x.shape)}")
    codes = weight.codes
    if k % 4 or codes.stride(1) != 1 or codes.stride(0) % 4 or codes.data_ptr() % 4:
        raise ValueError("int8_words_gemv reads the codes as 32-bit words: K and the row stride must be multiples of 4")
    if residual is not None and (residual.shape != (m, n) or residual.stride(1) != 1):
        raise ValueError(f"residual must be a [{m}, {n}] tensor with a contiguous last dim")
    if block_k % 16 or block_n < 16 or splits < 1 or warps < 1:
        raise ValueError(f"bad INT8 word-GEMV tiling {(block_n, block_k, splits, warps)}")
    rows = rows_per_program(m)
    out = torch.empty((m, n), dtype=weight.dtype, device=x.device)
    use_ws = splits > 1
    ws = torch.empty((splits, m, n), dtype=torch.float32, device=x.device) if use_ws else out  # [S, M, N]
    res = residual if residual is not None else out
    words = codes.view(torch.int32)  # [N, K / 4]
    grid = (triton.cdiv(n, block_n), splits, triton.cdiv(m, rows))
    # [split_counter_slots(N)] int32 arrival counts of the output tiles (not read without a split)
    counters = counters_for_tiles(weight, grid[0] * grid[2]) if use_ws else words
    pdl = programmatic_launch(x.device)
    _int8_words_gemv_kernel[grid](
        x, words, weight.col_scale, ws, res, out, counters, m, n, k, x.stride(0), words.stride(0), res.stride(0),
        out.stride(0), splits, BLOCK_N=block_n, C=block_k // 4, ROWS=rows, USE_WS=use_ws,
        HAS_RES=residual is not None, USE_PDL=pdl, num_warps=warps, **launch_options(pdl),
    )  # fmt: skip
    return out
