"""The NF4 streaming GEMV for one-row decode steps: out[M, N] = x[M, K] @ W[N, K]^T (+ residual), each row on its
own, reading bitsandbytes' NF4 layout in place (no repacking: rows of K / 2 bytes are read 128 contiguous bytes at a
time, which is whole cache lines, so the row-major layout is already coalesced).

Each program first copies the NF4 pair table into its shared memory (`quant_pair_table`: 256 fp16x2 level pairs, one
copy per lane so that no load conflicts; 32 KiB of static shared memory), then streams [BLOCK_N, 8 NB] packed words
per step (NB 64-value blocks of BLOCK_N weight rows; a thread loads 16 bytes; Triton's software pipeline keeps the
next steps in flight while one is computed) and computes every word's dot product with its 8 values of x in
registers with one inline-PTX program (`quant_pair_table.dot_ptx`): each byte's two fp16 levels by one shared load,
multiplied with x as fp16x2, 4 products per half summed in fp16 and the halves in fp32 (19 instructions per 8
values, 4 of them shared loads, against the register lookup's 28). x is loaded 16 bytes at a time and converted
once per thread and step (bf16: scaled by 2^-8 into fp16, exact for 2^-9 <= |x| and within 2^-17 absolute below,
finite up to 2^22; the output is multiplied back by 2^8), or, `prescaled`, read as the RMSNorm / SiLU kernel
before it already wrote it so converted (the same bits; docs/decisions/0023). Each block's word sums are added in
fp32 and scaled once by its decoded absmax (uint8 code -> nested code table * second-level absmax + offset, the
reference's fp32 value); a split of K across programs is summed in split order by the last program of each output
tile (`quant_splits`: one launch).

Numerics: fp16 levels (relative error <= 2^-11), fp16 products and 4-term sums (each <= 2^-11 of its magnitude):
within the bf16 rounding of bitsandbytes' dequantized weights; the same bits as the register lookup it replaced
(docs/decisions/0021). Batch invariance: one row per program, the same instructions in the same K order whatever
the other rows hold. The first step's weight lines are prefetched into L2 before the table copy (and, with
programmatic launch on, before the wait for the previous kernel: quant_splits). CUDA-graph safe. Importing fails
without Triton; the inline PTX runs on NVIDIA GPUs only (`quant_pair_table.emulate_dot` is its CPU twin)."""

from __future__ import annotations

import ctypes

import torch
import triton
import triton.language as tl

from corolla.engine.kernels.quant_splits import (
    finish_row,
    finish_split_rows,
    launch_options,
    programmatic_launch,
    wait_for_producer,
)
from corolla.engine.quant import quant_pair_table
from corolla.engine.quant.quant_mma import absmax_lookup
from corolla.engine.quant.quant_weights import NF4Weight, counters_for_tiles

# (BLOCK_N, 64-value blocks per step, K splits, num_warps, pipeline stages): the tilings within 5% of the best on
# some Llama-3-8B projection on an H200, and the tuner's pick for w_gate_up in the step of that call
# (`python -m benchmarks.engine.quant_probe --rows 1 --stream_sweep`, docs/decisions/0021; 8 blocks per step and 256
# rows on 4 warps run out of registers)
NF4_STREAM_CONFIGS: tuple[tuple[int, int, int, int, int], ...] = (
    (64, 4, 4, 4, 2),
    (64, 4, 8, 4, 2),
    (64, 4, 8, 4, 3),
    (128, 4, 2, 4, 2),
    (128, 4, 4, 4, 2),
    (128, 4, 8, 4, 2),
    (128, 4, 8, 4, 3),
    (128, 4, 8, 8, 3),
    (256, 4, 8, 8, 2),
)
PAIR_TABLE_WARPS = (4, 8)  # the warp counts the pair table's copy is written for (quant_pair_table.init_ptx)
X_SCALE = 2.0**-8  # bf16 x into fp16: times this before the conversion, the output times its inverse

_PAIR_DOT = tl.constexpr(quant_pair_table.dot_ptx())
_PAIR_C = tl.constexpr(quant_pair_table.DOT_CONSTRAINTS)
_PAIR_INIT4 = tl.constexpr(quant_pair_table.init_ptx(4))
_PAIR_INIT8 = tl.constexpr(quant_pair_table.init_ptx(8))
_PAIR_INIT_C = tl.constexpr(quant_pair_table.INIT_CONSTRAINTS)

# x: 16 bytes = 8 values at one address; bf16 pairs split into fp32 (shift / mask), scaled by 2^-8 and packed to
# fp16x2 (the even value in the low half); fp16 passes through
_X_BF16 = tl.constexpr("""{
.reg .b32 %p<4>; .reg .f32 %lo, %hi;
ld.global.nc.v4.b32 {%p0, %p1, %p2, %p3}, [$4];
shl.b32 %lo, %p0, 16; and.b32 %hi, %p0, 0xffff0000; mul.rn.f32 %lo, %lo, 0f3B800000; mul.rn.f32 %hi, %hi, 0f3B800000;
cvt.rn.f16x2.f32 $0, %hi, %lo;
shl.b32 %lo, %p1, 16; and.b32 %hi, %p1, 0xffff0000; mul.rn.f32 %lo, %lo, 0f3B800000; mul.rn.f32 %hi, %hi, 0f3B800000;
cvt.rn.f16x2.f32 $1, %hi, %lo;
shl.b32 %lo, %p2, 16; and.b32 %hi, %p2, 0xffff0000; mul.rn.f32 %lo, %lo, 0f3B800000; mul.rn.f32 %hi, %hi, 0f3B800000;
cvt.rn.f16x2.f32 $2, %hi, %lo;
shl.b32 %lo, %p3, 16; and.b32 %hi, %p3, 0xffff0000; mul.rn.f32 %lo, %lo, 0f3B800000; mul.rn.f32 %hi, %hi, 0f3B800000;
cvt.rn.f16x2.f32 $3, %hi, %lo;
}""")
_X_F16 = tl.constexpr("ld.global.nc.v4.b32 {$0, $1, $2, $3}, [$4];")


@triton.jit
def _absmax_loads(aq_ptrs, na_ptrs):
    # (uint8 absmax code, second-level absmax) of each block, in inline PTX so that they take the layout of their use;
    # not pure, so that the compiler issues them where they stand (a step ahead of their use)
    return tl.inline_asm_elementwise(
        """{
        .reg .b16 %c16;
        ld.global.nc.u8 %c16, [$2];
        cvt.u32.u16 $0, %c16;
        ld.global.nc.f32 $1, [$3];
        }""",
        "=r,=r,l,l", [aq_ptrs.to(tl.int64), na_ptrs.to(tl.int64)],
        dtype=(tl.int32, tl.float32), is_pure=False, pack=1,
    )  # fmt: skip


@triton.jit
def _prefetch_l2(ptrs):
    # the cache line at each pointer into L2 (a row's step of NB * 32 bytes: at most 128, one line); not pure, so
    # that it stays where it stands (before the wait for the previous kernel)
    return tl.inline_asm_elementwise(
        "prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [ptrs.to(tl.int64)], dtype=tl.int32, is_pure=False, pack=1
    )


@triton.jit
def _init_pair_table(pair_ptr, WARPS: tl.constexpr):
    # the pair table into this program's shared memory (quant_pair_table), then a barrier: one element per thread,
    # so that the PTX (which declares the table) is emitted exactly once
    ptrs = pair_ptr + tl.zeros([WARPS * 32], dtype=tl.int32)
    return tl.inline_asm_elementwise(
        _PAIR_INIT4 if WARPS == 4 else _PAIR_INIT8, _PAIR_INIT_C, [ptrs.to(tl.int64)],
        dtype=tl.int32, is_pure=False, pack=1,
    )  # fmt: skip


@triton.jit
def _word_dots(words, x_ptrs, X_BF16: tl.constexpr):
    # words [B, W] int32, x_ptrs [1, W] (8 values of x each, 16-byte aligned) -> [B, W] fp32 dot products.
    # x is loaded in inline PTX so that it takes the layout of its use (as the scales: a tl.load anchors its own)
    x0, x1, x2, x3 = tl.inline_asm_elementwise(
        _X_BF16 if X_BF16 else _X_F16, "=r,=r,=r,=r,l", [x_ptrs.to(tl.int64)],
        dtype=(tl.int32,) * 4, is_pure=True, pack=1,
    )  # fmt: skip
    # not pure: it reads the shared table, so it must stay after the table's copy
    return tl.inline_asm_elementwise(
        _PAIR_DOT, _PAIR_C, [words, x0, x1, x2, x3], dtype=tl.float32, is_pure=False, pack=1
    )


@triton.jit
def _nf4_stream_kernel(
    x_ptr, q_ptr, aq_ptr, na_ptr, nc_ptr, pair_ptr, ws_ptr, res_ptr, out_ptr, cnt_ptr,
    M, N, K, stride_xm, stride_qn, stride_rm, stride_om, offset, splits, out_scale,
    BLOCK_N: tl.constexpr, NB: tl.constexpr, X_BF16: tl.constexpr, USE_WS: tl.constexpr, HAS_RES: tl.constexpr,
    STAGES: tl.constexpr, USE_PDL: tl.constexpr, WARPS: tl.constexpr,
):  # fmt: skip
    # program (n tile, split, row): W[n tile, the split's steps of NB blocks] against x[row]. q_ptr: the packed bytes
    # as int32 words (8 per block and row), stride_qn in words per row. Rows past N are clamped into bounds (loads
    # never mask, so they stay 16 bytes wide; those rows are not stored).
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    row = tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.minimum(offs_n, N - 1)
    offs_w = tl.arange(0, NB * 8)  # the step's words of a row: block w // 8, word w % 8 of it
    offs_b = tl.arange(0, NB)
    WORDS: tl.constexpr = NB * 8
    steps = K // (64 * NB)  # the wrapper makes NB divide the row's blocks: every step is whole
    per_split = tl.cdiv(steps, splits)
    lo = split * per_split
    hi = tl.minimum(lo + per_split, steps)
    w_rows = q_ptr + rows[:, None] * stride_qn + offs_w[None, :]  # [BLOCK_N, WORDS] words of step 0
    x_row = x_ptr + row * stride_xm + offs_w[None, :] * 8  # [1, WORDS]: word w's 8 values, 16-byte aligned
    blocks = rows[:, None] * (K // 64) + offs_b[None, :]  # [BLOCK_N, NB] absmax blocks of step 0
    # [BLOCK_N, NB] block sums, made as a reduction of a 3-D zero so they start in the layout the loop adds in
    acc = tl.sum(tl.zeros([BLOCK_N, NB, 8], dtype=tl.float32), axis=2)
    # Triton's pipeliner keeps STAGES - 1 steps of words in flight (asynchronous copies through shared memory, read
    # back in the layout of their use); the absmax codes (4 bytes per row and step: too narrow for those copies) and
    # second-level absmaxes are loaded a step ahead in registers
    first = blocks + tl.minimum(lo, steps - 1) * NB  # (a split past the last step runs no step: stores zeros)
    code, nested = _absmax_loads(aq_ptr + first, na_ptr + first // 256)
    # the first step's weight lines into L2 while the table is copied (and the previous kernel runs, programmatic
    # launch): a program runs only a few steps, so its first DRAM round trip is a large part of its time
    _prefetch_l2(q_ptr + rows * stride_qn + tl.minimum(lo, steps - 1) * WORDS)  # [BLOCK_N]: a row's step
    _init_pair_table(pair_ptr, WARPS)
    wait_for_producer(USE_PDL)  # x and the residual come from the previous kernel
    for s in tl.range(lo, hi, num_stages=STAGES):
        nxt = blocks + tl.minimum(s + 1, steps - 1) * NB  # [BLOCK_N, NB] (the last step re-reads its own)
        code_next, nested_next = _absmax_loads(aq_ptr + nxt, na_ptr + nxt // 256)
        words = tl.load(w_rows + s * WORDS)  # [BLOCK_N, WORDS] int32, 16 bytes per thread
        dots = _word_dots(words, x_row + s * WORDS * 8, X_BF16)
        scale = absmax_lookup(code, nested, nc_ptr, offset)
        acc += tl.sum(tl.reshape(dots, [BLOCK_N, NB, 8]), axis=2) * scale
        code = code_next
        nested = nested_next
    vals = tl.sum(acc, axis=1) * out_scale  # [BLOCK_N]
    finish_row(vals, row, offs_n, M, N, split, ws_ptr, res_ptr, ws_ptr, out_ptr, stride_rm, stride_om, USE_WS,
               HAS_RES, False)  # fmt: skip
    if USE_WS:  # K split: the tile's last program sums the splits (quant_splits)
        finish_split_rows(cnt_ptr, row * tl.num_programs(0) + pid_n, splits, row, offs_n, M, N, ws_ptr, res_ptr,
                          ws_ptr, out_ptr, stride_rm, stride_om, ws_ptr, 0, 1, K, 0.0, 1, HAS_RES, False,
                          False)  # fmt: skip


def check_stream_config(config: tuple[int, int, int, int, int]) -> None:
    """ValueError unless `config` is a valid (BLOCK_N, NB, splits, warps, stages) tiling (tile sizes powers of 2)."""
    block_n, nb, splits, warps, stages = config
    pow2 = all(v >= 1 and v & (v - 1) == 0 for v in (block_n, nb, warps))
    if not pow2 or block_n < 16 or splits < 1 or stages < 1:
        raise ValueError(f"bad NF4 streaming GEMV config {config}")


def nf4_stream_gemv(
    x: torch.Tensor,
    weight: NF4Weight,
    residual: torch.Tensor | None,
    config: tuple[int, int, int, int, int],
    *,
    prescaled: bool = False,
) -> torch.Tensor:
    """x [M, K] @ W[N, K]^T (+ residual [M, N]) -> [M, N] in the weight's dtype (bf16 or fp16; each row read on its
    own: meant for one row); ValueError for a bad shape, dtype or config. `prescaled` (bf16 weights): x is fp16
    holding the bf16 input times X_SCALE, rounded as this kernel would convert it (`triton_kernels.rms_norm` /
    `silu_mul` with f16_scale=X_SCALE write it), so no program converts x again: the same bits, 16% fewer
    instructions per step. x is copied once when it does not start 16-byte aligned (the kernel reads it 16 bytes
    at a time)."""
    check_stream_config(config)
    m, k = x.shape
    n, wk = weight.shape
    x_dtype = torch.float16 if prescaled else weight.dtype
    if wk != k or m < 1 or x.dtype != x_dtype or weight.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"nf4_stream_gemv takes [M, {wk}] 16-bit {x_dtype} rows, got {tuple(x.shape)} {x.dtype}")
    if prescaled and weight.dtype != torch.bfloat16:
        raise ValueError("a prescaled fp16 x goes with bf16 weights (fp16 x is read as it is)")
    if weight.packed.stride(1) != 1 or weight.packed.stride(0) % 4 or weight.packed.data_ptr() % 16:
        raise ValueError("nf4_stream_gemv reads the packed bytes 16 at a time: rows contiguous and 16-byte aligned")
    if residual is not None and (residual.shape != (m, n) or residual.stride(1) != 1):
        raise ValueError(f"residual must be a [{m}, {n}] tensor with a contiguous last dim")
    if x.stride(1) != 1 or x.data_ptr() % 16 or x.stride(0) % 8:
        x = x.contiguous().clone()  # a fresh allocation: aligned
    block_n, nb, splits, warps, stages = config
    if warps not in PAIR_TABLE_WARPS:
        raise ValueError(f"the NF4 pair table is copied by {PAIR_TABLE_WARPS} warps, config {config} has {warps}")
    while (k // 64) % nb:  # whole steps only (Llama-3-8B's rows: 64 and 224 blocks)
        nb //= 2
    out = torch.empty((m, n), dtype=weight.dtype, device=x.device)
    use_ws = splits > 1
    ws = torch.empty((splits, m, n), dtype=torch.float32, device=x.device) if use_ws else out  # [S, M, N]
    res = residual if residual is not None else out
    words = weight.packed.view(torch.int32)  # [N, K / 8]
    grid = (triton.cdiv(n, block_n), splits, m)
    counters = counters_for_tiles(weight, grid[0] * m) if use_ws else words  # (not read without a split)
    x_bf16 = x.dtype == torch.bfloat16  # converted to fp16 by every program, else read as it is
    pdl = programmatic_launch(x.device)
    _nf4_stream_kernel[grid](
        x, words, weight.absmax_codes, weight.nested_absmax, weight.nested_code, weight.pair_words16, ws, res, out,
        counters,
        m, n, k, x.stride(0), words.stride(0), res.stride(0), out.stride(0), weight.nested_offset, splits,
        1.0 / X_SCALE if weight.dtype == torch.bfloat16 else 1.0,
        BLOCK_N=block_n, NB=nb, X_BF16=x_bf16, USE_WS=use_ws, HAS_RES=residual is not None, STAGES=stages,
        USE_PDL=pdl, WARPS=warps, num_warps=warps, **launch_options(pdl),
    )  # fmt: skip
    return out


_CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES = 1
_CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8


def _allow_dynamic_shared(module: object, function: int, name: str, *rest: object) -> None:
    # Triton raises a kernel's dynamic shared-memory limit above the default (48 KiB less its static memory) only
    # when its own buffers pass 48 KiB; the pair table's 32 KiB are static, so the streaming GEMV's pipeline buffers
    # get the rest of what the device allows a program beside them
    if name != _nf4_stream_kernel.fn.__name__:
        return
    cuda = ctypes.CDLL("libcuda.so.1")
    static = ctypes.c_int(0)
    if cuda.cuFuncGetAttribute(ctypes.byref(static), _CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES, ctypes.c_void_p(function)):
        raise RuntimeError("cuFuncGetAttribute failed on the NF4 streaming GEMV")
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    optin = props.shared_memory_per_block_optin  # type: ignore[attr-defined]  # (PyTorch's stubs lack it)
    limit = ctypes.c_int(optin - static.value)
    if cuda.cuFuncSetAttribute(ctypes.c_void_p(function), _CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, limit):
        raise RuntimeError("cuFuncSetAttribute failed on the NF4 streaming GEMV")


triton.knobs.runtime.kernel_load_end_hook.add(_allow_dynamic_shared)
