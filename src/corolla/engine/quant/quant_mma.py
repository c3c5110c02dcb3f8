"""NF4 projections on the matrix units for merged decode steps of 2 to `MMA_MAX_ROWS` rows (any 1..64 works),
reading bitsandbytes' NF4 layout in place: out[M, N] = x[M, K] @ W[N, K]^T (+ residual).

Each program decodes a 64-value block of BLOCK_N weight rows per step with the register lookup
(`quant_prmt.DECODE16_PROGRAM`: 21 instructions per 8 values, no conversion) and multiplies it with one `tl.dot`
(wgmma on Hopper) against a [64, BLOCK_M] tile of x as it is (no conversion), padded with zero rows up to BLOCK_M
(16 or 64). Two decodes (`fold`; the tuner times both, quant_choices "mma" / "mmaf"):
- folded: each row's block gets its own table, the 16 levels times the block's absmax (fp32, rounded once to the
  compute dtype: `quant_prmt.SCALED_TABLE_PROGRAM`, 32 instructions per row and block), so the lookup yields
  bitsandbytes' dequantized weights themselves and the matrix units accumulate every block straight into one fp32
  accumulator (no per-block product to zero, wait for and scale). It serves 64-row tiles (docs/decisions/0097)
  and competes at 16 rows.
- levels: the table holds the levels in the compute dtype (`lut_words`: bf16 levels for bf16 weights, fp16 for
  fp16); each block's fp32 product is scaled by its decoded absmax into the accumulator (decision 0068). 16-row
  tiles only.
The absmax is decoded as bitsandbytes decodes it (uint8 code -> nested code table * second-level absmax, rounded, +
offset, rounded). The words and absmax codes of the next two blocks are in flight in registers, and with
num_stages > 1 Triton's pipeliner streams the x tiles into shared memory ahead (cp.async); Triton waits for each
block's wgmma right after its issue (decision 0116).

Numerics: folded, the weights are bitsandbytes' dequantized values bit for bit (a one-hot row reads them back
exactly) and the exact products are summed in fp32; levels, each level is rounded once to the compute dtype (bf16:
relative error <= 2^-8, the size of the bf16 rounding of bitsandbytes' own dequantized weight; fp16: <= 2^-11) and
the exact products summed in fp32 (relative 2.7e-3 against x @ the dequantized weight on random rows, the folded
path 1.7e-3: the output's own bf16 rounding).

Batch invariance: each output element is its own column of the matrix product, computed by the same instructions
in the same K order whatever the other rows hold; a split of K is summed in split order by the last program of
each output tile to finish (an arrival count per tile in `NF4Weight.split_counters()`, reset by that program, as in
`quant_splits`: one launch per projection). DecodeOps keeps one config per row range. CUDA-graph safe. Importing
fails without Triton; the inline PTX runs on NVIDIA GPUs only (tests/helpers/kernel_emulation.py runs its CPU twin)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from corolla.engine.kernels.quant_splits import arrive_last, reset_counter
from corolla.engine.quant.quant_prmt import (
    DECODE16_CONSTRAINTS,
    SCALED_TABLE_CONSTRAINTS,
    decode16_ptx,
    scaled_table_ptx,
)
from corolla.engine.quant.quant_weights import NF4Weight, counters_for_tiles

MMA_MAX_ROWS = 64
MMA_MID_MAX_ROWS = 16  # DecodeOps serves 2 to this many rows with the 16-row-tile configs, more with 64-row tiles
# registers a thread for 64-row tiles: ptxas fits them unspilled, and 4 programs of 4 warps (2 of 8) stay resident
# on a multiprocessor (uncapped, the pipelined builds take 130 and one program fewer)
MAX_REGS_64 = 128

# (BLOCK_N, BLOCK_M, K splits, num_warps, num_stages): the tilings that came within 10% of the best on some Llama-3-8B
# projection on an H200 (16 rows: 16-row tiles, both decodes; 64 rows: folded 64-row tiles with x pipelined in 3
# stages; docs/decisions/0068, 0097)
NF4_MMA_CONFIGS: tuple[tuple[int, int, int, int, int], ...] = (
    *((64, 16, s, 4, 1) for s in (2, 4, 8)),
    *((128, 16, s, 4, 1) for s in (2, 4, 8)),
    *((64, 64, s, 4, 3) for s in (1, 2, 3, 4, 6, 8)),
    (128, 64, 8, 8, 3),
)

_PTX16 = tl.constexpr(decode16_ptx())
_CONSTRAINTS16 = tl.constexpr(DECODE16_CONSTRAINTS)
_TABLE_BF16 = tl.constexpr(scaled_table_ptx(torch.bfloat16))
_TABLE_F16 = tl.constexpr(scaled_table_ptx(torch.float16))
_TABLE_CONSTRAINTS = tl.constexpr(SCALED_TABLE_CONSTRAINTS)


@triton.jit
def _levels(words, t0, t1, t2, t3, t4, t5, t6, t7, BF16: tl.constexpr):
    # words [B, C] int32 -> [B, 8 C] levels in the table's 16-bit type (bf16 or fp16: the same byte permutes),
    # element 8c + t of the row at 8c + t
    if BF16:
        v0, v1, v2, v3, v4, v5, v6, v7 = tl.inline_asm_elementwise(
            _PTX16, _CONSTRAINTS16, [words, t0, t1, t2, t3, t4, t5, t6, t7],
            dtype=(tl.bfloat16,) * 8, is_pure=True, pack=1,
        )  # fmt: skip
    else:
        v0, v1, v2, v3, v4, v5, v6, v7 = tl.inline_asm_elementwise(
            _PTX16, _CONSTRAINTS16, [words, t0, t1, t2, t3, t4, t5, t6, t7],
            dtype=(tl.float16,) * 8, is_pure=True, pack=1,
        )  # fmt: skip
    even = tl.join(tl.join(v0, v4), tl.join(v2, v6))  # [B, C, 2, 2]: t = 4 a + 2 b
    odd = tl.join(tl.join(v1, v5), tl.join(v3, v7))
    return tl.reshape(tl.join(even, odd), [words.shape[0], words.shape[1] * 8])


@triton.jit
def _absmax_code(aq_ptrs, na_ptrs):
    # (the uint8 absmax code of each block, its second-level absmax), loaded in inline PTX (read-only, in bounds:
    # callers clamp) so that they take the layout of their use (a tl.load anchors its own layout, which Triton then
    # converts through shared memory)
    return tl.inline_asm_elementwise(
        """{
        .reg .b16 %c16;
        ld.global.nc.u8 %c16, [$2];
        cvt.u32.u16 $0, %c16;
        ld.global.nc.f32 $1, [$3];
        }""",
        "=r,=r,l,l", [aq_ptrs.to(tl.int64), na_ptrs.to(tl.int64)],
        dtype=(tl.int32, tl.float32), is_pure=True, pack=1,
    )  # fmt: skip


@triton.jit
def absmax_lookup(code, nested, nc_ptr, offset):
    # the decoded absmax: nested_code[code] * nested, rounded, + offset, rounded (fp32: bitsandbytes' value, as
    # NF4Weight.block_absmax forms it; an fma would round once and differ in the last bit)
    return tl.inline_asm_elementwise(
        """{
        .reg .b64 %a; .reg .f32 %e;
        mad.wide.u32 %a, $1, 4, $3;
        ld.global.nc.f32 %e, [%a];
        mul.rn.f32 %e, %e, $2;
        add.rn.f32 $0, %e, $4;
        }""",
        "=r,r,r,l,r", [code, nested, nc_ptr.to(tl.int64), offset],
        dtype=tl.float32, is_pure=True, pack=1,
    )  # fmt: skip


@triton.jit
def _scaled_table(scale, c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12, c13, c14, c15, BF16: tl.constexpr):
    # [B] fp32 block absmaxes -> the 8 table words [B] of each block's dequantized levels (quant_prmt's folded table)
    if BF16:
        words = tl.inline_asm_elementwise(
            _TABLE_BF16, _TABLE_CONSTRAINTS,
            [scale, c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12, c13, c14, c15],
            dtype=(tl.int32,) * 8, is_pure=True, pack=1,
        )  # fmt: skip
    else:
        words = tl.inline_asm_elementwise(
            _TABLE_F16, _TABLE_CONSTRAINTS,
            [scale, c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12, c13, c14, c15],
            dtype=(tl.int32,) * 8, is_pure=True, pack=1,
        )  # fmt: skip
    return words


@triton.jit
def _folded(words, scale, c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12, c13, c14, c15,
            BF16: tl.constexpr):  # fmt: skip
    # words [B, C] int32 of one block of each row, scale [B] its absmax -> [B, 8 C] dequantized weights (16-bit)
    t0, t1, t2, t3, t4, t5, t6, t7 = _scaled_table(
        scale, c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12, c13, c14, c15, BF16
    )
    return _levels(words, t0[:, None], t1[:, None], t2[:, None], t3[:, None], t4[:, None], t5[:, None],
                   t6[:, None], t7[:, None], BF16)  # fmt: skip


@triton.jit
def _nf4_mma_kernel(
    x_ptr, q_ptr, aq_ptr, na_ptr, nc_ptr, ws_ptr, res_ptr, out_ptr, cnt_ptr,
    M, N, K, stride_xm, stride_qn, stride_rm, stride_om, offset, splits,
    t0, t1, t2, t3, t4, t5, t6, t7,
    c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12, c13, c14, c15,
    BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BF16: tl.constexpr, USE_WS: tl.constexpr,
    HAS_RES: tl.constexpr, FOLD: tl.constexpr,
):  # fmt: skip
    # program (n tile, split, row tile): out^T[n tile, row tile] over the split's 64-value blocks. q_ptr: the packed
    # bytes as int32 words (8 per block and row), stride_qn in words per row. Rows past N and blocks past the split
    # are read clamped in bounds (their values never reach a stored output).
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    pid_m = tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, 64)
    kb = K // 64
    per_split = tl.cdiv(kb, splits)
    lo = split * per_split
    hi = tl.minimum(lo + per_split, kb)
    last = kb - 1
    rows = tl.minimum(offs_n, N - 1)  # [BLOCK_N]
    w_ptrs = q_ptr + rows[:, None] * stride_qn + tl.arange(0, 8)[None, :]  # [BLOCK_N, 8] words of block 0
    x_ptrs = x_ptr + offs_m[None, :] * stride_xm + offs_k[:, None]  # [64, BLOCK_M] x^T of block 0
    x_mask = (offs_m < M)[None, :]
    row_blocks = rows * kb  # [BLOCK_N] first absmax block of each row
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    # Block b + 2's words and absmax code are loaded and block b + 1's absmax looked up (its code arrived a step
    # ago) a step ahead, so no load latency (nor the code -> table chain) sits between two blocks; x is loaded where
    # it is used, for the pipeliner.
    words0 = tl.load(w_ptrs + tl.minimum(lo, last) * 8)
    words1 = tl.load(w_ptrs + tl.minimum(lo + 1, last) * 8)
    gb = row_blocks + tl.minimum(lo, last)
    code0, nested0 = _absmax_code(aq_ptr + gb, na_ptr + (gb >> 8))
    gb = row_blocks + tl.minimum(lo + 1, last)
    code1, nested1 = _absmax_code(aq_ptr + gb, na_ptr + (gb >> 8))
    if FOLD:
        # each block's table holds its dequantized weights (level x absmax, rounded once as bitsandbytes rounds
        # them), so the matrix units accumulate straight into acc: no per-block product to scale. Block b + 1 is
        # decoded while nothing waits on it (its table's absmax looked up a step ahead).
        scale0 = absmax_lookup(code0, nested0, nc_ptr, offset)  # [BLOCK_N]
        w = _folded(words0, scale0, c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12, c13, c14, c15, BF16)
        scale1 = absmax_lookup(code1, nested1, nc_ptr, offset)
        for b in range(lo, hi):
            words2 = tl.load(w_ptrs + tl.minimum(b + 2, last) * 8)
            gb = row_blocks + tl.minimum(b + 2, last)
            code2, nested2 = _absmax_code(aq_ptr + gb, na_ptr + (gb >> 8))
            xt = tl.load(x_ptrs + b * 64, mask=x_mask, other=0.0)  # [64, BLOCK_M]
            acc = tl.dot(w, xt, acc)  # [BLOCK_N, BLOCK_M] fp32
            w = _folded(words1, scale1, c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12, c13, c14, c15, BF16)
            scale1 = absmax_lookup(code2, nested2, nc_ptr, offset)
            words1 = words2
    else:
        # block b's wgmma is issued, then block b + 1 decoded, then block b's product scaled into acc
        scale0 = absmax_lookup(code0, nested0, nc_ptr, offset)  # [BLOCK_N]
        w = _levels(words0, t0, t1, t2, t3, t4, t5, t6, t7, BF16)  # [BLOCK_N, 64] block lo
        for b in range(lo, hi):
            words2 = tl.load(w_ptrs + tl.minimum(b + 2, last) * 8)
            gb = row_blocks + tl.minimum(b + 2, last)
            code2, nested2 = _absmax_code(aq_ptr + gb, na_ptr + (gb >> 8))
            scale1 = absmax_lookup(code1, nested1, nc_ptr, offset)
            xt = tl.load(x_ptrs + b * 64, mask=x_mask, other=0.0)  # [64, BLOCK_M]
            part = tl.dot(w, xt)  # [BLOCK_N, BLOCK_M] fp32
            w = _levels(words1, t0, t1, t2, t3, t4, t5, t6, t7, BF16)  # block b + 1
            acc += part * scale0[:, None]
            words1 = words2
            code1 = code2
            nested1 = nested2
            scale0 = scale1
    mask = (offs_n < N)[:, None] & x_mask  # [BLOCK_N, BLOCK_M]
    o_off = offs_m[None, :] * stride_om + offs_n[:, None]
    r_off = offs_m[None, :] * stride_rm + offs_n[:, None]
    if USE_WS:  # K split: partial sums to ws[split, M, N]; the tile's last program sums them in split order
        w_off = offs_m[None, :] * N + offs_n[:, None]
        tl.store(ws_ptr + split * M * N + w_off, acc, mask=mask)
        tile = pid_m * tl.num_programs(0) + pid_n
        if arrive_last(cnt_ptr, tile, splits):
            total = tl.load(ws_ptr + w_off, mask=mask, other=0.0, cache_modifier=".cg")
            for s in range(1, splits):
                total += tl.load(ws_ptr + s * M * N + w_off, mask=mask, other=0.0, cache_modifier=".cg")
            if HAS_RES:
                total += tl.load(res_ptr + r_off, mask=mask, other=0.0).to(tl.float32)
            tl.store(out_ptr + o_off, total.to(out_ptr.dtype.element_ty), mask=mask)
            reset_counter(cnt_ptr, tile)
    else:
        if HAS_RES:
            acc += tl.load(res_ptr + r_off, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + o_off, acc.to(out_ptr.dtype.element_ty), mask=mask)


def register_cap(config: tuple[int, int, int, int, int]) -> int | None:
    """Registers a thread for `config`: MAX_REGS_64 for 64-row tiles whose fp32 accumulator takes <= 32 registers a
    thread, others left to ptxas. (The folded path fits in 80 unspilled, 6 programs a multiprocessor, but ran slower
    at 80 and 96 than at 128 on every Llama-3-8B projection: docs/decisions/0097-nf4-mma-folded-table.md.)"""
    block_n, block_m, _, warps, _ = config
    if block_m == 64 and block_n * block_m <= 32 * 32 * warps:
        return MAX_REGS_64
    return None


def nf4_mma_matmul(
    x: torch.Tensor,
    weight: NF4Weight,
    residual: torch.Tensor | None,
    config: tuple[int, int, int, int, int],
    fold: bool = False,
    max_regs: int | None = None,
) -> torch.Tensor:
    """x [M, K] (1 <= M <= MMA_MAX_ROWS, last dim contiguous, the weight's 16-bit dtype) @ W[N, K]^T (+ residual
    [M, N]) -> [M, N] in the weight's dtype; `fold`: each block decoded through its folded table (bitsandbytes'
    dequantized weights, accumulated by the matrix units), else through the levels with the product scaled per
    block. `max_regs`: the register cap per thread (None: `register_cap`'s). ValueError for a bad shape, dtype,
    alignment or config."""
    m, k = x.shape
    n, wk = weight.shape
    if wk != k or not 1 <= m <= MMA_MAX_ROWS or x.stride(1) != 1 or x.dtype != weight.dtype:
        raise ValueError(f"nf4_mma_matmul takes [1..{MMA_MAX_ROWS}, {wk}] {weight.dtype} rows, got {tuple(x.shape)}")
    if weight.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"nf4_mma_matmul runs 16-bit weights, got {weight.dtype}")
    if weight.packed.stride(1) != 1 or weight.packed.stride(0) % 4 or weight.packed.data_ptr() % 4:
        raise ValueError("nf4_mma_matmul reads the packed bytes as 32-bit words: rows must be 4-byte aligned")
    if residual is not None and (residual.shape != (m, n) or residual.stride(1) != 1):
        raise ValueError(f"residual must be a [{m}, {n}] tensor with a contiguous last dim")
    block_n, block_m, splits, warps, stages = config
    if block_n < 16 or block_m not in (16, 32, 64) or splits < 1 or warps < 1 or stages < 1:
        raise ValueError(f"bad NF4 matrix-unit config {config}")
    out = torch.empty((m, n), dtype=weight.dtype, device=x.device)
    use_ws = splits > 1
    ws = torch.empty((splits, m, n), dtype=torch.float32, device=x.device) if use_ws else out  # [S, M, N]
    res = residual if residual is not None else out
    words = weight.packed.view(torch.int32)  # [N, K / 8]
    grid = (triton.cdiv(n, block_n), splits, triton.cdiv(m, block_m))
    counters = counters_for_tiles(weight, grid[0] * grid[2]) if use_ws else words
    _nf4_mma_kernel[grid](
        x, words, weight.absmax_codes, weight.nested_absmax, weight.nested_code, ws, res, out, counters,
        m, n, k, x.stride(0), words.stride(0), res.stride(0), out.stride(0), weight.nested_offset, splits,
        *weight.lut_words, *weight.levels,
        BLOCK_N=block_n, BLOCK_M=block_m, BF16=weight.dtype == torch.bfloat16, USE_WS=use_ws,
        HAS_RES=residual is not None, FOLD=fold, num_warps=warps, num_stages=stages,
        maxnreg=register_cap(config) if max_regs is None else max_regs,
    )  # fmt: skip
    return out
