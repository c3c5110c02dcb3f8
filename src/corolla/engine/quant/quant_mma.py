"""NF4 projections on the matrix units for merged decode steps of 2 to `MMA_MAX_ROWS` rows (any 1..64 works),
reading bitsandbytes' NF4 layout in place: out[M, N] = x[M, K] @ W[N, K]^T (+ residual).

Each program decodes a 64-value block of BLOCK_N weight rows per step with the register lookup straight to fp16
levels (`quant_prmt.DECODE16_PROGRAM`: 21 instructions per 8 values, no conversion) and multiplies it with one
`tl.dot` (wgmma on Hopper) against a [64, BLOCK_M] tile of x, padded with zero rows up to BLOCK_M (16 or 64); each
block's fp32 partial product is scaled once by its decoded absmax (uint8 code -> nested code table * second-level
absmax + offset) and accumulated in fp32. The next two blocks' words, x tiles and absmax codes are in flight while
one block is decoded. The cost of a step barely grows with its rows, unlike the CUDA-core GEMV (quant_gemv), which
reads the weight again for every 4 rows: on an H200 (docs/decisions/0012-nf4-matrix-units.md) 16 rows of w_gate_up
take 63 us here against 148 us for 8 rows there, and 64 rows 100 us against 137 us for the tl.dot tile kernel this
replaced; one row runs a GEMV (46 us against 56 us here; quant_tile_gemv's matrix-unit GEMV since, ~24 us).

Numerics: the levels are the fp16-rounded NF4 levels (relative error <= 2^-11, as quant_prmt's CUDA-core GEMV);
x (bf16) is scaled by 2^-8 and converted to fp16, exact for |x| >= 2^-9 and within 2^-17 absolute below, finite up
to 2^24 (fp16 inputs are used as they are); the products are exact and summed in fp32, and the output multiplied
back by 2^8 (exact). Against the bf16 reference (x @ dequantized W) this stays within the bf16 rounding of the
dequantized weights.

Batch invariance: each output element is its own column of the matrix product, computed by the same instructions
in the same K order whatever the other rows hold; a split of K is summed in split order by the last program of
each output tile to finish (an arrival count per tile in `NF4Weight.split_counters()`, reset by that program, as in
`quant_splits`: one launch per projection). DecodeOps keeps one config per row range. CUDA-graph safe. Importing
fails without Triton; the inline PTX runs on NVIDIA GPUs only (`quant_prmt.emulate_decode16` is its CPU twin)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from corolla.engine.kernels.quant_splits import arrive_last, reset_counter, row_mask
from corolla.engine.quant.quant_prmt import DECODE16_CONSTRAINTS, decode16_ptx
from corolla.engine.quant.quant_weights import NF4Weight, counters_for_tiles

MMA_MAX_ROWS = 64
MMA_MID_MAX_ROWS = 16  # DecodeOps serves 2 to this many rows with the 16-row-tile configs, more with 64-row tiles
X_SCALE_LOG2 = 8  # bf16 x is multiplied by 2^-8 before its fp16 conversion, the output by 2^8

# (BLOCK_N, BLOCK_M, K splits, num_warps, num_stages): the tilings that came within 10% of the best on some Llama-3-8B
# projection on an H200 (16 rows: 16-row tiles, 64 rows: 64-row tiles; 256-wide tiles, a single split and 2 or 3
# pipeline stages never did, docs/decisions/0012-nf4-matrix-units.md)
NF4_MMA_CONFIGS: tuple[tuple[int, int, int, int, int], ...] = (
    *((64, 16, s, 4, 1) for s in (2, 4, 8)),
    *((128, 16, s, 4, 1) for s in (4, 8)),
    *((64, 64, s, 4, 1) for s in (2, 4)),
    (128, 64, 4, 4, 1),
    (128, 64, 4, 8, 1),
)

_PTX16 = tl.constexpr(decode16_ptx())
_CONSTRAINTS16 = tl.constexpr(DECODE16_CONSTRAINTS)


@triton.jit
def _levels16(words, t0, t1, t2, t3, t4, t5, t6, t7):
    # words [B, C] int32 -> [B, 8 C] fp16 levels, element 8c + t of the row at 8c + t
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
    # the decoded absmax: nested_code[code] * nested + offset (fp32, one fma: the reference's value)
    return tl.inline_asm_elementwise(
        """{
        .reg .b64 %a; .reg .f32 %e;
        mad.wide.u32 %a, $1, 4, $3;
        ld.global.nc.f32 %e, [%a];
        fma.rn.f32 $0, %e, $2, $4;
        }""",
        "=r,r,r,l,r", [code, nested, nc_ptr.to(tl.int64), offset],
        dtype=tl.float32, is_pure=True, pack=1,
    )  # fmt: skip


@triton.jit
def _nf4_mma_kernel(
    x_ptr, q_ptr, aq_ptr, na_ptr, nc_ptr, ws_ptr, res_ptr, out_ptr, cnt_ptr,
    M, N, K, stride_xm, stride_qn, stride_rm, stride_om, offset, splits,
    t0, t1, t2, t3, t4, t5, t6, t7,
    BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, X_BF16: tl.constexpr, USE_WS: tl.constexpr,
    HAS_RES: tl.constexpr,
):  # fmt: skip
    # program (n tile, split, row tile): out^T[n tile, row tile] over the split's 64-value blocks. q_ptr: the packed
    # bytes as int32 words (8 per block and row), stride_qn in words per row.
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    pid_m = tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_c = tl.arange(0, 8)
    offs_k = tl.arange(0, 64)
    kb = K // 64
    per_split = tl.cdiv(kb, splits)
    lo = split * per_split
    hi = tl.minimum(lo + per_split, kb)
    w_ptrs = q_ptr + offs_n[:, None] * stride_qn + offs_c[None, :]  # [BLOCK_N, 8] words of block 0
    x_ptrs = x_ptr + offs_m[None, :] * stride_xm + offs_k[:, None]  # [64, BLOCK_M] x^T of block 0
    x_mask = (offs_m < M)[None, :]
    row_blocks = tl.minimum(offs_n, N - 1) * kb  # [BLOCK_N] first absmax block of each row (clamped)
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    # software pipeline in registers, two blocks deep: block b + 2's words, absmax code and x are loaded while
    # block b is decoded and multiplied, and block b + 1's absmax is looked up (its code arrived a block ago), so no
    # load latency (nor the code -> table chain) sits between two blocks. Indices past the split are clamped in
    # bounds (their words masked to zero, their values unused).
    last = kb - 1
    words0 = tl.load(w_ptrs + lo * 8, mask=row_mask(offs_n, N, lo, hi)[:, None], other=0)
    words1 = tl.load(w_ptrs + (lo + 1) * 8, mask=row_mask(offs_n, N, lo + 1, hi)[:, None], other=0)
    x0 = tl.load(x_ptrs + tl.minimum(lo, last) * 64, mask=x_mask, other=0.0)  # [64, BLOCK_M]
    x1 = tl.load(x_ptrs + tl.minimum(lo + 1, last) * 64, mask=x_mask, other=0.0)
    gb = row_blocks + tl.minimum(lo, last)
    code0, nested0 = _absmax_code(aq_ptr + gb, na_ptr + gb // 256)
    gb = row_blocks + tl.minimum(lo + 1, last)
    code1, nested1 = _absmax_code(aq_ptr + gb, na_ptr + gb // 256)
    scale0 = absmax_lookup(code0, nested0, nc_ptr, offset)  # [BLOCK_N]
    for b in range(lo, hi):
        words2 = tl.load(w_ptrs + (b + 2) * 8, mask=row_mask(offs_n, N, b + 2, hi)[:, None], other=0)
        x2 = tl.load(x_ptrs + tl.minimum(b + 2, last) * 64, mask=x_mask, other=0.0)
        gb = row_blocks + tl.minimum(b + 2, last)
        code2, nested2 = _absmax_code(aq_ptr + gb, na_ptr + gb // 256)
        scale1 = absmax_lookup(code1, nested1, nc_ptr, offset)
        w = _levels16(words0, t0, t1, t2, t3, t4, t5, t6, t7)  # [BLOCK_N, 64] fp16
        xt = x0
        if X_BF16:
            xt = (xt.to(tl.float32) * 0.00390625).to(tl.float16)  # 2^-X_SCALE_LOG2
        part = tl.dot(w, xt)  # [BLOCK_N, BLOCK_M] fp32
        acc += part * scale0[:, None]
        words0 = words1
        words1 = words2
        x0 = x1
        x1 = x2
        code1 = code2
        nested1 = nested2
        scale0 = scale1
    if X_BF16:
        acc = acc * 256.0  # 2^X_SCALE_LOG2
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


def nf4_mma_matmul(
    x: torch.Tensor, weight: NF4Weight, residual: torch.Tensor | None, config: tuple[int, int, int, int, int]
) -> torch.Tensor:
    """x [M, K] (1 <= M <= MMA_MAX_ROWS, last dim contiguous, the weight's 16-bit dtype) @ W[N, K]^T (+ residual
    [M, N]) -> [M, N] in the weight's dtype; ValueError for a bad shape, dtype, alignment or config."""
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
    x_bf16 = weight.dtype == torch.bfloat16
    counters = counters_for_tiles(weight, grid[0] * grid[2]) if use_ws else words
    _nf4_mma_kernel[grid](
        x, words, weight.absmax_codes, weight.nested_absmax, weight.nested_code, ws, res, out, counters,
        m, n, k, x.stride(0), words.stride(0), res.stride(0), out.stride(0), weight.nested_offset, splits,
        *weight.lut_words,
        BLOCK_N=block_n, BLOCK_M=block_m, X_BF16=x_bf16, USE_WS=use_ws,
        HAS_RES=residual is not None, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out
