"""Split-K sums inside the quantized GEMV/GEMM kernels themselves (no second kernel), shared by the NF4 and INT8
kernels of quant_gemv, quant_int8_words, quant_prmt_kernels and quant_kernels.

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

Programmatic dependent launch (an experiment, off unless `set_programmatic_launch(True)`; `quant_bench
--programmatic_launch` measures it): on sm_90+ the kernels are launched with `launch_pdl`, so their programs may
start while the kernel before them (RMSNorm, attention, SiLU) finishes; each waits (`wait_for_producer`,
griddepcontrol.wait: the previous grid complete and its writes visible) before it reads anything another kernel
wrote (x, residual) and before it writes; only the immutable weight bytes may be read before. Importing fails
without Triton."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_PROGRAMMATIC_LAUNCH = {"enabled": False}


def set_programmatic_launch(enabled: bool) -> None:
    """Turns programmatic dependent launch of the quantized GEMV/GEMM kernels on or off for this process (calls
    made after it; a CUDA graph keeps what it captured)."""
    _PROGRAMMATIC_LAUNCH["enabled"] = bool(enabled)


def programmatic_launch(device: torch.device) -> bool:
    """Whether kernels on `device` launch with programmatic dependent launch (turned on, and sm_90 or newer)."""
    if not _PROGRAMMATIC_LAUNCH["enabled"] or device.type != "cuda":
        return False
    return torch.cuda.get_device_capability(device)[0] >= 9


def launch_options(use_pdl: bool) -> dict[str, bool]:
    """Extra launch keywords of a kernel call: none unless programmatic launch is on (older Tritons know no
    `launch_pdl`)."""
    return {"launch_pdl": True} if use_pdl else {}


@triton.jit
def wait_for_producer(USE_PDL: tl.constexpr):
    # with programmatic launch: wait until the previous kernel completed and its writes are visible
    if USE_PDL:
        tl.extra.cuda.gdc_wait()


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
def sum_split_row(row, offs_n, M, N, splits, ws_ptr, res_ptr, cs_ptr, out_ptr, stride_rm, stride_om,
                  HAS_RES: tl.constexpr, HAS_SCALE: tl.constexpr):  # fmt: skip
    # out[row, offs_n] = (sum over s in order of ws[s, row, offs_n]) * col_scale (+ residual), offs_n [BLOCK_N]
    mask = (offs_n < N) & (row < M)
    acc = tl.load(ws_ptr + row * N + offs_n, mask=mask, other=0.0, cache_modifier=".cg")
    for s in range(1, splits):
        acc += tl.load(ws_ptr + (s * M + row) * N + offs_n, mask=mask, other=0.0, cache_modifier=".cg")
    if HAS_SCALE:
        acc = acc * tl.load(cs_ptr + offs_n, mask=offs_n < N, other=0.0)
    if HAS_RES:
        acc += tl.load(res_ptr + row * stride_rm + offs_n, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_om + offs_n, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def sum_split_tile(offs_m, offs_n, M, N, splits, ws_ptr, res_ptr, cs_ptr, out_ptr, stride_rm, stride_om,
                   HAS_RES: tl.constexpr, HAS_SCALE: tl.constexpr):  # fmt: skip
    # the same for a tile: offs_m [TM] rows x offs_n [BLOCK_N] columns
    mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    ptrs = ws_ptr + offs_m[:, None] * N + offs_n[None, :]  # [TM, BLOCK_N] split 0
    acc = tl.load(ptrs, mask=mask, other=0.0, cache_modifier=".cg")
    for s in range(1, splits):
        acc += tl.load(ptrs + s * M * N, mask=mask, other=0.0, cache_modifier=".cg")
    if HAS_SCALE:
        acc = acc * tl.load(cs_ptr + offs_n, mask=offs_n < N, other=0.0)[None, :]
    if HAS_RES:
        acc += tl.load(res_ptr + offs_m[:, None] * stride_rm + offs_n[None, :], mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def finish_split_rows(cnt_ptr, tile, splits, row0, offs_n, M, N, ws_ptr, res_ptr, cs_ptr, out_ptr, stride_rm,
                      stride_om, ROWS: tl.constexpr, HAS_RES: tl.constexpr, HAS_SCALE: tl.constexpr):  # fmt: skip
    # a GEMV program's end after storing the partial sums of rows row0 + [0, ROWS): the tile's last program sums
    # them (ROWS = 1, 2 or 4)
    if arrive_last(cnt_ptr, tile, splits):
        sum_split_row(row0, offs_n, M, N, splits, ws_ptr, res_ptr, cs_ptr, out_ptr, stride_rm, stride_om,
                      HAS_RES, HAS_SCALE)  # fmt: skip
        if ROWS >= 2:
            sum_split_row(row0 + 1, offs_n, M, N, splits, ws_ptr, res_ptr, cs_ptr, out_ptr, stride_rm, stride_om,
                          HAS_RES, HAS_SCALE)  # fmt: skip
        if ROWS >= 4:
            sum_split_row(row0 + 2, offs_n, M, N, splits, ws_ptr, res_ptr, cs_ptr, out_ptr, stride_rm, stride_om,
                          HAS_RES, HAS_SCALE)  # fmt: skip
            sum_split_row(row0 + 3, offs_n, M, N, splits, ws_ptr, res_ptr, cs_ptr, out_ptr, stride_rm, stride_om,
                          HAS_RES, HAS_SCALE)  # fmt: skip
        reset_counter(cnt_ptr, tile)
