"""Causal attention of a short prefill chunk that reads its sequence's keys and values straight from the pool's
pages, split over the keys (flash-decoding style), with the chunk's start and length read on the device: the whole
chunk after a reused prefix, every layer, can then be one CUDA graph (`engine.graphs.prefill_graphs`) that serves any
prefix length (issue 34, docs/decisions/0019).

torch's fixed-shape flash attention splits over the keys but takes its key count from the host (a graph would hold
one prefix length), its variable-length form has no split over the keys (twice as slow), and both need the keys
gathered out of the pages first (figures: 0019). Here a program takes `BLOCK_M` (query row, head) pairs of one K/V head group (the
group's query heads share its keys: 132 rows x 4 heads make 528 rows for one K/V head in Llama-3-8B) and one of `S`
equal ranges of the keys; a second kernel combines the ranges' partial softmax sums. Programs whose rows are all
padding return at once; keys at or below every row's position need no mask (the long prefix), only the last blocks
do. Importing fails without Triton; `prefill_attention.paged_prefill_attention_ref` is the reference."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634


@dataclass(frozen=True)
class PrefillAttentionConfig:
    """A launch of the split kernel: (query row, head) pairs per program, keys per loop step, warps, pipeline
    stages, key ranges `splits` (chosen per chunk bucket, `PrefillGraphs`)."""

    block_m: int
    block_n: int
    warps: int
    stages: int
    splits: int


# the launches `PrefillGraphs` times per row bucket (each compiles once per process): the three best of an H200's
# timing at 160 rows x 32 heads over 4,096 keys, 32 Llama-3-8B layers (0019)
ATTENTION_CONFIGS = (
    PrefillAttentionConfig(64, 64, 4, 2, 8),
    PrefillAttentionConfig(128, 64, 8, 2, 8),
    PrefillAttentionConfig(64, 64, 4, 2, 4),
)


@triton.jit
def _prefill_split_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    index_ptr,
    m_ptr,
    l_ptr,
    acc_ptr,
    stride_qr,
    qk_scale,
    R,
    G: tl.constexpr,
    NQ: tl.constexpr,
    NKV: tl.constexpr,
    D: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    S: tl.constexpr,
):
    # index [2 + maxp] int32: the chunk's first position, its rows t, the sequence's block table
    pid_m = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    start = tl.load(index_ptr)
    t = tl.load(index_ptr + 1)
    m0 = pid_m * BLOCK_M
    if m0 < t * G:  # (else: padding rows only; the combine writes zeros there)
        offs_m = m0 + tl.arange(0, BLOCK_M)  # (row, head in group) pairs: row = m // G
        row = offs_m // G
        head = kvh * G + offs_m % G
        m_valid = row < t
        offs_d = tl.arange(0, D)
        q = tl.load(q_ptr + row[:, None] * stride_qr + head[:, None] * D + offs_d[None, :], mask=m_valid[:, None],
                    other=0.0)  # fmt: skip
        pos = start + row  # [BLOCK_M] each row's position: it sees keys [0, pos]
        total = start + t
        last_row = tl.minimum((m0 + BLOCK_M - 1) // G, t - 1)
        per_split = tl.cdiv(tl.cdiv(total, BLOCK_N), S) * BLOCK_N  # keys of a range, whole loop steps
        n_lo = split * per_split
        n_hi = tl.minimum(n_lo + per_split, start + last_row + 1)  # the block's last row sees up to its position
        # keys up to the block's first row's position are seen by every row: those loop steps need no mask
        open_end = tl.minimum(n_hi, start + m0 // G + 1)
        full_end = n_lo + tl.maximum(open_end - n_lo, 0) // BLOCK_N * BLOCK_N
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)
        token_stride: tl.constexpr = NKV * D
        offs_n = tl.arange(0, BLOCK_N)
        for n in range(n_lo, full_end, BLOCK_N):
            keys = n + offs_n
            page = tl.load(index_ptr + 2 + keys // PAGE).to(tl.int64)  # [BLOCK_N]
            kv = (page * PAGE + keys % PAGE) * token_stride + kvh * D  # [BLOCK_N] offsets of the keys' heads
            k = tl.load(k_ptr + kv[None, :] + offs_d[:, None])  # [D, BLOCK_N]
            s = tl.dot(q, k) * qk_scale  # [BLOCK_M, BLOCK_N], log2 units
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            p = tl.math.exp2(s - m_new[:, None])
            alpha = tl.math.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v = tl.load(v_ptr + kv[:, None] + offs_d[None, :])  # [BLOCK_N, D]
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
        for n in range(full_end, n_hi, BLOCK_N):  # the diagonal: each row sees keys up to its own position
            keys = n + offs_n
            in_range = keys < n_hi
            page = tl.load(index_ptr + 2 + keys // PAGE, mask=in_range, other=0).to(tl.int64)  # (page 0: the trash)
            kv = (page * PAGE + keys % PAGE) * token_stride + kvh * D
            k = tl.load(k_ptr + kv[None, :] + offs_d[:, None])  # [D, BLOCK_N]
            s = tl.dot(q, k) * qk_scale
            seen = (keys[None, :] <= pos[:, None]) & in_range[None, :]
            s = tl.where(seen, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen no key yet
            p = tl.math.exp2(s - m_safe[:, None])
            alpha = tl.math.exp2(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v = tl.load(v_ptr + kv[:, None] + offs_d[None, :])  # [BLOCK_N, D]
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
        # partials [S, R, NQ(, D)] fp32, by (split, row, head); rows of a range that saw no key: m -inf, l 0
        part = (split * R + row) * NQ + head  # [BLOCK_M]
        tl.store(m_ptr + part, m_i, mask=m_valid)
        tl.store(l_ptr + part, l_i, mask=m_valid)
        tl.store(acc_ptr + part[:, None] * D + offs_d[None, :], acc, mask=m_valid[:, None])


@triton.jit
def _prefill_combine_kernel(
    index_ptr,
    m_ptr,
    l_ptr,
    acc_ptr,
    out_ptr,
    stride_or,
    R,
    NQ: tl.constexpr,
    NQP: tl.constexpr,
    D: tl.constexpr,
    S: tl.constexpr,
):
    # one row's NQ heads (NQP: a power of two): the S ranges' partials weighed by exp2(m_s - max_s m_s); padding
    # rows (>= t) get zeros
    row = tl.program_id(0)
    t = tl.load(index_ptr + 1)
    offs_h = tl.arange(0, NQP)
    h_mask = offs_h < NQ
    offs_d = tl.arange(0, D)
    dst = out_ptr + row * stride_or + offs_h[:, None] * D + offs_d[None, :]  # [NQP, D]
    if row < t:
        m_all = tl.full([NQP], float("-inf"), dtype=tl.float32)
        for s in tl.static_range(S):
            m_all = tl.maximum(m_all, tl.load(m_ptr + (s * R + row) * NQ + offs_h, mask=h_mask, other=0.0))
        l_all = tl.zeros([NQP], dtype=tl.float32)
        acc = tl.zeros([NQP, D], dtype=tl.float32)
        for s in tl.static_range(S):
            part = (s * R + row) * NQ + offs_h  # [NQP]
            m_s = tl.load(m_ptr + part, mask=h_mask, other=0.0)
            w = tl.where(m_s == float("-inf"), 0.0, tl.math.exp2(m_s - m_all))  # a range that saw no key: 0
            l_all += tl.load(l_ptr + part, mask=h_mask, other=1.0) * w
            acc += tl.load(acc_ptr + part[:, None] * D + offs_d[None, :], mask=h_mask[:, None], other=0.0) * w[:, None]
        tl.store(dst, (acc / l_all[:, None]).to(out_ptr.dtype.element_ty), mask=h_mask[:, None])
    else:
        tl.store(dst, tl.zeros([NQP, D], dtype=out_ptr.dtype.element_ty), mask=h_mask[:, None])


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    index: torch.Tensor,
    *,
    scale: float,
    config: PrefillAttentionConfig,
) -> torch.Tensor:
    """Same contract as `prefill_attention.paged_prefill_attention_ref`: q [R, nq, D] (last dim contiguous),
    k_cache/v_cache [pages, page, nkv, D], index [2 + maxp] int32 on the device -> [R, nq, D]. No host
    synchronization (capturable)."""
    r, nq, d = q.shape
    page, nkv = k_cache.shape[1], k_cache.shape[2]
    if q.stride(2) != 1 or nq % nkv or d < 16 or d & (d - 1):
        raise ValueError(f"paged_prefill_attention takes grouped heads of a power-of-two size, got q {tuple(q.shape)}")
    group, s = nq // nkv, config.splits
    m = torch.empty((s, r, nq), dtype=torch.float32, device=q.device)
    l_ = torch.empty_like(m)
    acc = torch.empty((s, r, nq, d), dtype=torch.float32, device=q.device)
    out = torch.empty((r, nq, d), dtype=q.dtype, device=q.device)
    _prefill_split_kernel[(triton.cdiv(r * group, config.block_m), nkv, s)](
        q, k_cache, v_cache, index, m, l_, acc, q.stride(0), scale * LOG2E, r,
        G=group, NQ=nq, NKV=nkv, D=d, PAGE=page, BLOCK_M=config.block_m, BLOCK_N=config.block_n, S=s,
        num_warps=config.warps, num_stages=config.stages,
    )  # fmt: skip
    _prefill_combine_kernel[(r,)](
        index, m, l_, acc, out, out.stride(0), r, NQ=nq, NQP=triton.next_power_of_2(nq), D=d, S=s, num_warps=4
    )
    return out
