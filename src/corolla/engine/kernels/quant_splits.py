"""Split-K sums inside the quantized GEMV/GEMM kernels themselves (no second kernel), shared by the NF4 and INT8
kernels of quant_gemv, quant_mma and quant_kernels, and quant_gemv's row helpers (`rows_per_program`, `finish_row`),
so that none of those modules imports another's kernels.

A kernel that splits K over `splits` programs per output tile stores each program's fp32 partial sums in a
workspace ws[split, M, N], then every program counts itself in the tile's arrival counter (`arrive_last`: a CTA
barrier so that all of the program's stores come first, then one acq_rel atomic add at GPU scope). The program
that arrives last sums the tile's splits in split order 0, 1, ..., splits - 1 (`sum_split_row` for one row,
`sum_split_tile` for a 16-row tile; L2 reads, since other programs wrote them), applies the column scale and the
residual (in the same order as a kernel that does not split) and writes the output, then puts the counter back to
zero (`reset_counter`), so the next call (or CUDA-graph replay) starts from zero without a memset.

Determinism: the order of the sum does not depend on which program arrives last, so the same inputs give bit-equal
outputs, and a row's output does not depend on the other rows of the call. The counters belong to the weight
(`NF4Weight.split_counters()` / `Int8Weight.split_counters()`): calls on one weight must not run concurrently on
two streams.

The RMSNorm prologue (`quant.prologues.PROLOGUES`; the INT8 tl.dot block kernel; decode rows) scales x by the
norm's gain per k as it is loaded (fp32, not rounded to x's dtype before the product, as the separate kernel's
output is) and sums x^2 over the program's K range; the row's 1/rms multiplies the finished dot product (before the
column scale and the residual). With a split each program also stores its partial sum of squares in ss[split, M,
tiles] and the last program sums them in split order (`split_rstd`); a program that covers all of K uses its own
sum. (SiLU gating before a quantized projection runs as its own kernel: fused, it never won; decision 0242.)
Importing fails without Triton."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def arrive_last(cnt_ptr, tile, splits):
    # True in the program that completes output tile `tile` (its `splits` programs each call this once, after
    # storing their partial sums)
    tl.debug_barrier()  # every thread's partial sums stored before the (release) count
    return tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel", scope="gpu") == splits - 1


@triton.jit
def reset_counter(cnt_ptr, tile):
    tl.atomic_xchg(cnt_ptr + tile, 0, sem="relaxed", scope="gpu")  # ready for the next call (graph replay)


@triton.jit
def row_mask(offs, limit, row, M):
    # offs < limit in a row that exists (row < M), else none: one compare (Triton's interpreter widens a tensor mask
    # and-ed with a scalar condition to int32, which its loads refuse)
    return offs < tl.where(row < M, limit, 0)


@triton.jit
def rstd_of(sum_sq, K, eps):
    # 1/rms of a row from its sum of squares over all K (as triton_kernels.rms_norm forms it)
    return 1.0 / tl.sqrt(sum_sq / K + eps)


@triton.jit
def split_rstd(ss_ptr, rows, tile, M, n_tiles, splits, K, eps):
    # rows (scalar or [TM]) of output tile `tile`: the splits' partial sums of squares ss[s, row, tile] summed in
    # split order (other programs wrote them: L2 reads) -> 1/rms
    mask = rows < M
    ptrs = ss_ptr + rows * n_tiles + tile
    sq = tl.load(ptrs, mask=mask, other=0.0, cache_modifier=".cg")
    for s in range(1, splits):
        sq += tl.load(ptrs + s * M * n_tiles, mask=mask, other=0.0, cache_modifier=".cg")
    return rstd_of(sq, K, eps)


def rows_per_program(m: int) -> int:
    """Rows one program multiplies against its decoded weight tile (each with its own accumulator)."""
    return 1 if m == 1 else 2 if m == 2 else 4


@triton.jit
def finish_row(vals, row, offs_n, M, N, split, ws_ptr, res_ptr, out_ptr, stride_rm, stride_om, USE_WS: tl.constexpr,
               HAS_RES: tl.constexpr):  # fmt: skip
    # vals [BLOCK_N] fp32 of one row: finished here (residual, cast) or kept as a split's partial sum
    mask = row_mask(offs_n, N, row, M)
    if USE_WS:
        tl.store(ws_ptr + (split * M + row) * N + offs_n, vals, mask=mask)
    else:
        if HAS_RES:
            vals += tl.load(res_ptr + row * stride_rm + offs_n, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * stride_om + offs_n, vals.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def sum_split_row(row, offs_n, M, N, splits, ws_ptr, res_ptr, out_ptr, stride_rm, stride_om, HAS_RES: tl.constexpr):
    # out[row, offs_n] = sum over s in order of ws[s, row, offs_n] (+ residual), offs_n [BLOCK_N]
    mask = row_mask(offs_n, N, row, M)
    acc = tl.load(ws_ptr + row * N + offs_n, mask=mask, other=0.0, cache_modifier=".cg")
    for s in range(1, splits):
        acc += tl.load(ws_ptr + (s * M + row) * N + offs_n, mask=mask, other=0.0, cache_modifier=".cg")
    if HAS_RES:
        acc += tl.load(res_ptr + row * stride_rm + offs_n, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_om + offs_n, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def sum_split_tile(offs_m, offs_n, M, N, splits, ws_ptr, res_ptr, cs_ptr, out_ptr, stride_rm, stride_om, rs,
                   HAS_RES: tl.constexpr, HAS_SCALE: tl.constexpr, NORM: tl.constexpr):  # fmt: skip
    # the same for a tile: offs_m [TM] rows x offs_n [BLOCK_N] columns (rs [TM] with NORM)
    mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    ptrs = ws_ptr + offs_m[:, None] * N + offs_n[None, :]  # [TM, BLOCK_N] split 0
    acc = tl.load(ptrs, mask=mask, other=0.0, cache_modifier=".cg")
    for s in range(1, splits):
        acc += tl.load(ptrs + s * M * N, mask=mask, other=0.0, cache_modifier=".cg")
    if NORM:
        acc = acc * rs[:, None]
    if HAS_SCALE:
        acc = acc * tl.load(cs_ptr + offs_n, mask=offs_n < N, other=0.0)[None, :]
    if HAS_RES:
        acc += tl.load(res_ptr + offs_m[:, None] * stride_rm + offs_n[None, :], mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def finish_split_rows(cnt_ptr, tile, splits, row0, offs_n, M, N, ws_ptr, res_ptr, out_ptr, stride_rm, stride_om,
                      ROWS: tl.constexpr, HAS_RES: tl.constexpr):  # fmt: skip
    # a GEMV program's end after storing the partial sums of rows row0 + [0, ROWS): the tile's last program sums
    # them (ROWS = 1, 2 or 4)
    if arrive_last(cnt_ptr, tile, splits):
        for r in tl.static_range(ROWS):
            sum_split_row(row0 + r, offs_n, M, N, splits, ws_ptr, res_ptr, out_ptr, stride_rm, stride_om, HAS_RES)
        reset_counter(cnt_ptr, tile)
