"""Triton kernels of the decode step: the rows' KV slots and lengths (one kernel instead of torch's seven small ones),
RMSNorm, rotary embedding fused with the KV-cache write, paged decode
attention (split over the sequence, the splits combined by the last program of each (row, kv head); optional ALiBi
bias from per-head slopes) and SiLU-gated product. Importing fails without Triton."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from corolla.engine.kernels.alibi_triton import alibi_bias
from corolla.engine.kernels.attention_counters import attention_counters
from corolla.engine.kernels.nvrtc_kernels import programmatic_launches
from corolla.engine.kernels.quant_splits import arrive_last, reset_counter

# ---------------------------------------------------------------------------------------------- RMSNorm


@triton.jit
def _store_out(ptrs, y, mask, out_scale, SCALED: tl.constexpr, x_dtype: tl.constexpr):
    # y rounded to the input's dtype; SCALED: then (exactly, in fp32) times out_scale and rounded to fp16 (the
    # output's dtype), as the NF4 tile GEMV would convert that input itself (quant_tile_gemv's prescaled x)
    y = y.to(x_dtype)
    if SCALED:
        y = (y.to(tl.float32) * out_scale).to(tl.float16)
    tl.store(ptrs, y, mask=mask)


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, stride_x, stride_o, n_cols, eps, out_scale, BLOCK: tl.constexpr,
                     SCALED: tl.constexpr):  # fmt: skip
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < n_cols
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / n_cols + eps)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0)
    y = (x * rstd).to(w.dtype) * w  # rounded before scaling, as the reference layer does
    _store_out(out_ptr + row * stride_o + offs, y, mask, out_scale, SCALED, x_ptr.dtype.element_ty)


def _scaled_output(x: torch.Tensor, shape: tuple[int, int], f16_scale: float | None) -> torch.Tensor:
    # the output of a kernel with input x: x's dtype, or fp16 for a scaled output (bf16 / fp16 inputs only)
    if f16_scale is not None and x.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"a scaled fp16 output takes a 16-bit input, got {x.dtype}")
    return torch.empty(shape, dtype=x.dtype if f16_scale is None else torch.float16, device=x.device)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, f16_scale: float | None = None) -> torch.Tensor:
    """x [N, H] (last dim contiguous), weight [H] -> [N, H] in x's dtype; with `f16_scale`: that result times
    f16_scale, rounded to fp16 (the NF4 streaming GEMV's prescaled input)."""
    n, h = x.shape
    out = _scaled_output(x, (n, h), f16_scale)
    block = triton.next_power_of_2(h)
    _rms_norm_kernel[(n,)](
        x, weight, out, x.stride(0), out.stride(0), h, eps, f16_scale or 1.0, BLOCK=block,
        SCALED=f16_scale is not None, num_warps=8,
    )  # fmt: skip
    return out


# ---------------------------------------------------------------------------------------------- KV slots


@triton.jit
def _decode_slots_kernel(
    pos_ptr, bt_ptr, slots_ptr, lens_ptr, rows, stride_bt, PAGE: tl.constexpr, BLOCK: tl.constexpr
):
    # row r writes its token at slot = block_tables[r, pos // PAGE] * PAGE + pos % PAGE and attends to pos + 1 tokens
    offs = tl.arange(0, BLOCK)
    mask = offs < rows
    pos = tl.load(pos_ptr + offs, mask=mask, other=0).to(tl.int64)
    page = tl.load(bt_ptr + offs.to(tl.int64) * stride_bt + pos // PAGE, mask=mask, other=0).to(tl.int64)
    tl.store(slots_ptr + offs, page * PAGE + pos % PAGE, mask=mask)
    tl.store(lens_ptr + offs, (pos + 1).to(tl.int32), mask=mask)


def decode_slots(positions: torch.Tensor, block_tables: torch.Tensor, page: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as `decode_ops.decode_slots_ref`: positions [B] long, block_tables [B, maxp] int32 ->
    (flat KV slot of each row's position [B] long, sequence lengths positions + 1 [B] int32)."""
    rows = positions.shape[0]
    if block_tables.shape[0] != rows or block_tables.stride(1) != 1 or positions.dtype != torch.long:
        raise ValueError("decode_slots takes positions [B] long and block tables [B, maxp] with contiguous rows")
    slots = torch.empty(rows, dtype=torch.long, device=positions.device)
    lens = torch.empty(rows, dtype=torch.int32, device=positions.device)
    if rows:
        block = max(16, triton.next_power_of_2(rows))
        _decode_slots_kernel[(1,)](
            positions, block_tables, slots, lens, rows, block_tables.stride(0), PAGE=page, BLOCK=block, num_warps=1
        )
    return slots, lens


# ---------------------------------------------------------------------------------------------- RoPE + KV write


@triton.jit
def _rope_store_kernel(
    qkv_ptr,
    cos_ptr,
    sin_ptr,
    pos_ptr,
    slot_ptr,
    q_out_ptr,
    k_ptr,
    v_ptr,
    stride_qkv,
    stride_qo_n,
    stride_slot,
    NQ: tl.constexpr,
    NKV: tl.constexpr,
    D: tl.constexpr,
    ROTATE: tl.constexpr,
    PDL: tl.constexpr,
):
    if PDL:  # a programmatic launch: the attention after it may start (it waits for this kernel before it reads)
        gdc_launch_dependents()
        gdc_wait()  # the projection ahead complete, its writes visible
    row = tl.program_id(0)
    head = tl.program_id(1)  # [0, NQ): queries, [NQ, NQ + NKV): keys, then values
    HALF: tl.constexpr = D // 2
    offs = tl.arange(0, HALF)
    src = qkv_ptr + row * stride_qkv + head * D
    x1 = tl.load(src + offs)
    x2 = tl.load(src + HALF + offs)
    slot = tl.load(slot_ptr + row).to(tl.int64)
    if head < NQ + NKV:
        if ROTATE:
            pos = tl.load(pos_ptr + row).to(tl.int64)
            c = tl.load(cos_ptr + pos * HALF + offs)
            s = tl.load(sin_ptr + pos * HALF + offs)
            a = x1.to(tl.float32)
            b = x2.to(tl.float32)
            y1 = (a * c - b * s).to(x1.dtype)
            y2 = (b * c + a * s).to(x1.dtype)
        else:  # ALiBi spans: keys and queries as projected
            y1 = x1
            y2 = x2
        if head < NQ:
            dst = q_out_ptr + row * stride_qo_n + head * D
        else:
            dst = k_ptr + slot * stride_slot + (head - NQ) * D
        tl.store(dst + offs, y1)
        tl.store(dst + HALF + offs, y2)
    else:
        dst = v_ptr + slot * stride_slot + (head - NQ - NKV) * D
        tl.store(dst + offs, x1)
        tl.store(dst + HALF + offs, x2)


def rope_and_store(
    qkv, cos, sin, positions, slots, k_cache, v_cache, num_heads, num_kv_heads, head_dim, *, rotate: bool = True
):
    """Same contract as `ops.rope_and_store_ref`; one program per (row, head)."""
    n = qkv.shape[0]
    q_out = torch.empty((n, num_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    stride_slot = num_kv_heads * head_dim  # caches are [pages, page, nkv, D], contiguous
    grid = (n, num_heads + 2 * num_kv_heads)
    pdl = programmatic_launches(qkv.device)
    _rope_store_kernel[grid](
        qkv, cos, sin, positions, slots, q_out, k_cache, v_cache,
        qkv.stride(0), q_out.stride(0), stride_slot,
        NQ=num_heads, NKV=num_kv_heads, D=head_dim, ROTATE=rotate, PDL=pdl, num_warps=1, launch_pdl=pdl,
    )  # fmt: skip
    return q_out


# ---------------------------------------------------------------------------------------------- paged attention


@triton.jit
def _paged_attn_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    bt_ptr,
    pos_ptr,
    out_ptr,
    m_ptr,
    l_ptr,
    acc_ptr,
    cnt_ptr,
    slopes_ptr,
    rows,
    stride_qb,
    stride_qh,
    stride_bt,
    stride_ob,
    stride_oh,
    scale,
    alibi_scale,
    pages_per_split,
    unsplit_pages,
    G: tl.constexpr,
    GP: tl.constexpr,
    NKV: tl.constexpr,
    D: tl.constexpr,
    PAGE: tl.constexpr,
    S: tl.constexpr,
    GC: tl.constexpr,
    ALIBI: tl.constexpr,
    EARLY: tl.constexpr,
    PDL: tl.constexpr,
    RELEASE: tl.constexpr,
):
    if PDL:
        if RELEASE:
            # a programmatic launch (after the RoPE + KV write): the kernel after it, w_o's GEMV, may start now,
            # its programs building their tables and issuing their first weight loads where these leave room (each
            # waits for this kernel before it reads its output: docs/decisions/0275); else it starts as this
            # kernel ends (docs/decisions/0288)
            gdc_launch_dependents()
    # ALIBI (ops.ALIBI_*): 0 none; else score += round(slope[head] * key_position) * alibi_scale (alibi_triton)
    # A row takes as many of the grid's S splits as it has `pages_per_split` pages (at least one; one for a row of at
    # most `unsplit_pages`, whose combine would cost more than its pages): a long row beside short ones is split where
    # they are not, and the splits it does not take return at once. The count depends on the row's own length (and
    # the launch's constants) only, so a row's output does not depend on the other rows.
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    pos = tl.load(pos_ptr + b)  # [] int64 (the step's input: see EARLY)
    seq_len = (pos + 1).to(tl.int32)
    n_pages = tl.cdiv(seq_len, PAGE)
    taken = tl.minimum(tl.maximum(tl.cdiv(n_pages, pages_per_split), 1), S)  # the row's splits
    taken = tl.where(n_pages <= unsplit_pages, 1, taken)
    per_split = tl.cdiv(n_pages, taken)
    p_start = split * per_split
    p_end = tl.minimum(p_start + per_split, n_pages)
    if EARLY:
        # (a grid of at most one program a multiprocessor: docs/decisions/0278) A split of one page reads it before
        # the wait: the positions and block tables are the step's inputs (copied in before its first kernel), the
        # page's tokens were written by earlier steps but for those this step writes that the row attends to: its
        # own at `pos` and, where the step holds several rows of its sequence, theirs before it. Those are
        # consecutive rows at consecutive positions over one table (graph_decode.merge_rows' order: a shadow's or a
        # speculative step's T tokens; no row writes into another sequence's pages), so at most rows - 1 positions
        # before `pos`: offsets [lo, hi] of the page, re-read after the wait. Both reads L2 only (.cg): no line of
        # the page sits in L1 from before the wait for a read after it to hit.
        early = (split < taken) & (p_end - p_start == 1)
        offs_t = tl.arange(0, PAGE)
        offs_d = tl.arange(0, D)
        token_stride: tl.constexpr = NKV * D
        page_stride: tl.constexpr = PAGE * NKV * D
        page_id = tl.load(bt_ptr + b * stride_bt + p_start, mask=early, other=0).to(tl.int64)
        tile = page_id * page_stride + kvh * D + offs_t[:, None] * token_stride + offs_d[None, :]  # [PAGE, D]
        k0 = tl.load(k_ptr + tile, mask=early, other=0.0, cache_modifier=".cg")  # [PAGE, D]
        v0 = tl.load(v_ptr + tile, mask=early, other=0.0, cache_modifier=".cg")
        first = p_start * PAGE
        lo = tl.maximum(pos - (rows - 1), first) - first
        hi = pos - first
    if PDL:
        gdc_wait()  # the RoPE + KV write ahead complete, its writes visible
    if split < taken:
        if EARLY:
            fresh = (offs_t >= lo) & (offs_t <= hi) & early  # [PAGE]
            k0 = tl.where(fresh[:, None], tl.load(k_ptr + tile, mask=fresh[:, None], cache_modifier=".cg"), k0)
            v0 = tl.where(fresh[:, None], tl.load(v_ptr + tile, mask=fresh[:, None], cache_modifier=".cg"), v0)
        else:
            early = split < 0
            k0 = 0.0
            v0 = 0.0
        _paged_attn_split(
            q_ptr, k_ptr, v_ptr, bt_ptr, out_ptr, m_ptr, l_ptr, acc_ptr, cnt_ptr, slopes_ptr,
            stride_qb, stride_qh, stride_bt, stride_ob, stride_oh, scale, alibi_scale,
            b, kvh, split, seq_len, taken, p_start, p_end, early, k0, v0, G, GP, NKV, D, PAGE, S, GC, ALIBI, EARLY,
        )  # fmt: skip


@triton.jit
def _paged_attn_split(
    q_ptr, k_ptr, v_ptr, bt_ptr, out_ptr, m_ptr, l_ptr, acc_ptr, cnt_ptr, slopes_ptr,
    stride_qb, stride_qh, stride_bt, stride_ob, stride_oh, scale, alibi_scale,
    b, kvh, split, seq_len, taken, p_start, p_end, early, k0, v0,
    G: tl.constexpr, GP: tl.constexpr, NKV: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr, S: tl.constexpr,
    GC: tl.constexpr, ALIBI: tl.constexpr, EARLY: tl.constexpr,
):  # fmt: skip
    # split `split` of the `taken` splits of (row b, kv head kvh), pages [p_start, p_end) (`early`: its one page's
    # keys and values are k0, v0 [PAGE, D]): its pages' partial softmax sums; with one split the output itself, else
    # the partials to the scratch, the last of the `taken` to arrive combining them
    offs_g = tl.arange(0, GP)
    offs_d = tl.arange(0, D)
    offs_t = tl.arange(0, PAGE)
    g_mask = offs_g < G
    q = tl.load(
        q_ptr + b * stride_qb + (kvh * G + offs_g)[:, None] * stride_qh + offs_d[None, :],
        mask=g_mask[:, None],
        other=0.0,
    )  # [GP, D]
    if ALIBI != 0:
        slopes = tl.load(slopes_ptr + kvh * G + offs_g, mask=g_mask, other=0.0)  # [GP] fp32
    m_i = tl.full([GP], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([GP], dtype=tl.float32)
    acc = tl.zeros([GP, D], dtype=tl.float32)
    start = p_start
    if EARLY:
        if early:  # the page read before the wait: no running maximum to rescale yet
            s = tl.dot(q, tl.trans(k0)) * scale  # [GP, PAGE]
            if ALIBI != 0:
                s = s + alibi_bias(slopes, p_start * PAGE + offs_t, alibi_scale, ALIBI)  # [GP, PAGE]
            s = tl.where(((p_start * PAGE + offs_t) < seq_len)[None, :], s, float("-inf"))
            m_i = tl.max(s, axis=1)  # [GP]
            probs = tl.exp(s - m_i[:, None])
            l_i = tl.sum(probs, axis=1)
            acc = tl.dot(probs.to(v0.dtype), v0)  # [GP, D] fp32
            start = p_start + 1
    token_stride: tl.constexpr = NKV * D
    page_stride: tl.constexpr = PAGE * NKV * D
    for p in range(start, p_end):
        page_id = tl.load(bt_ptr + b * stride_bt + p).to(tl.int64)
        base = page_id * page_stride + kvh * D
        tile = base + offs_t[:, None] * token_stride + offs_d[None, :]
        k = tl.load(k_ptr + tile)  # [PAGE, D]
        s = tl.dot(q, tl.trans(k)) * scale  # [GP, PAGE]
        if ALIBI != 0:
            s = s + alibi_bias(slopes, p * PAGE + offs_t, alibi_scale, ALIBI)  # [GP, PAGE]
        valid = (p * PAGE + offs_t) < seq_len
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        probs = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(probs, axis=1)
        v = tl.load(v_ptr + tile)  # [PAGE, D]
        acc = acc * alpha[:, None] + tl.dot(probs.to(v.dtype), v)
        m_i = m_new
    dst = out_ptr + b * stride_ob + (kvh * G + offs_g)[:, None] * stride_oh + offs_d[None, :]  # [GP, D]
    if S == 1:  # (a launch without splits compiles no scratch code)
        tl.store(dst, (acc / l_i[:, None]).to(out_ptr.dtype.element_ty), mask=g_mask[:, None])
    elif taken == 1:
        tl.store(dst, (acc / l_i[:, None]).to(out_ptr.dtype.element_ty), mask=g_mask[:, None])
    else:
        pair = b * NKV + kvh
        rows = (pair * S + split) * GP + offs_g  # scratch layout [B, NKV, S, GP(, D)]; padded heads not stored
        tl.store(m_ptr + rows, m_i, mask=g_mask)
        tl.store(l_ptr + rows, l_i, mask=g_mask)
        tl.store(acc_ptr + rows[:, None] * D + offs_d[None, :], acc, mask=g_mask[:, None])
        if arrive_last(cnt_ptr, pair, taken):  # the pair's last split program combines its splits
            offs_c = tl.arange(0, GC)  # the real heads (G of GC), not the tl.dot padding
            out = combine_splits(m_ptr, l_ptr, acc_ptr, pair * S * GP + offs_c, GP, offs_c < G, offs_d, taken, GC, D, S)
            dst_c = out_ptr + b * stride_ob + (kvh * G + offs_c)[:, None] * stride_oh + offs_d[None, :]  # [GC, D]
            tl.store(dst_c, out.to(out_ptr.dtype.element_ty), mask=(offs_c < G)[:, None])
            reset_counter(cnt_ptr, pair)


@triton.jit
def combine_splits(m_ptr, l_ptr, acc_ptr, rows0, split_stride, row_mask, offs_d, taken, R: tl.constexpr,
                   D: tl.constexpr, S: tl.constexpr):  # fmt: skip
    # a split attention's partials -> [R, D] fp32: R rows (rows0 [R]: split 0's scratch rows, split s's rows0 + s
    # split_stride; maxima m and sums l [rows], sums acc [rows, D]) of the first `taken` (<= S) splits, read from L2
    # (other programs wrote them), unrolled so that the loads are in flight together, summed in split order. Each
    # split's maximum and weight are formed elementwise beside its acc rows (picking a split's row out of an [S, R]
    # tile by a reduction cost ~5 CTA barriers a split: 89 in a combine of 16 splits on sm_90).
    m_all = tl.full([R], float("-inf"), dtype=tl.float32)
    for s in tl.static_range(S):
        rows = rows0 + s * split_stride  # [R] (the same addresses as below: one load each)
        on = row_mask & (s < taken)
        m_all = tl.maximum(m_all, tl.load(m_ptr + rows, mask=on, other=float("-inf"), cache_modifier=".cg"))
    l_all = tl.zeros([R], dtype=tl.float32)
    acc = tl.zeros([R, D], dtype=tl.float32)
    for s in tl.static_range(S):
        on = row_mask & (s < taken)
        rows = rows0 + s * split_stride  # [R]
        m_s = tl.load(m_ptr + rows, mask=on, other=float("-inf"), cache_modifier=".cg")
        w_s = tl.where(m_s == float("-inf"), 0.0, tl.exp(m_s - m_all))  # [R]; empty splits weigh nothing
        l_all += tl.load(l_ptr + rows, mask=on, other=0.0, cache_modifier=".cg") * w_s
        part = tl.load(acc_ptr + rows[:, None] * D + offs_d[None, :], mask=on[:, None], other=0.0, cache_modifier=".cg")
        acc += part * w_s[:, None]
    return acc / l_all[:, None]


# fmt: off
def paged_decode_attention(
    q, k_cache, v_cache, block_tables, positions, scale: float, splits: int, *, pages_per_split: int = 1,
    unsplit_pages: int = 0, alibi_slopes: torch.Tensor | None = None, alibi_scale: float = 1.0, alibi_mode: int = 0,
    early: bool = False, release: bool = False,
) -> torch.Tensor:
    # fmt: on
    """`ops.paged_decode_attention_ref`'s contract, the rows' lengths given as their `positions` [B] long (each
    attends to positions + 1 tokens: the step's new token at its position, written by the kernel ahead, with any
    other row's of its sequence); a row of P pages is split over min(splits, ceil(P /
    `pages_per_split`)) programs per kv head (one where P <= `unsplit_pages`; the grid's other split programs return
    at once), the last of them to finish combining their partials (`attention_counters`). With `alibi_mode` != 0,
    `alibi_slopes` [nq] fp32 gives each query head's slope (see the kernel's ALIBI modes). With `early` (for grids of
    at most one program a multiprocessor: it costs registers) a split of one page reads it before the kernel's wait
    for the RoPE + KV write ahead, which takes a step's rows of one sequence as consecutive rows at consecutive
    positions (graph_decode.merge_rows' order). With `release` (programmatic launches) the kernel after it may start
    at this one's start rather than at its end (for a GEMV whose programs each take a multiprocessor: DecodeOps.
    on_tile_gemv)."""
    if splits < 1:  # a grid of no programs would return the output tensor unwritten
        raise ValueError(f"splits must be >= 1, got {splits}")
    if pages_per_split < 1:
        raise ValueError(f"pages_per_split must be >= 1, got {pages_per_split}")
    b, nq, d = q.shape
    page, nkv = k_cache.shape[1], k_cache.shape[2]
    group = nq // nkv
    gp = max(16, triton.next_power_of_2(group))
    out = torch.empty_like(q)
    if splits > 1:
        counters = attention_counters(q.device, b * nkv)
        m = torch.empty((b, nkv, splits, gp), dtype=torch.float32, device=q.device)
        l_ = torch.empty_like(m)
        acc = torch.empty((b, nkv, splits, gp, d), dtype=torch.float32, device=q.device)
    else:
        m = l_ = acc = counters = out  # unused
    if alibi_mode != 0 and (alibi_slopes is None or alibi_slopes.shape != (nq,)):
        raise ValueError(f"ALiBi attention needs one slope per query head ({nq})")
    if positions.shape != (b,) or positions.dtype != torch.long or block_tables.shape[0] != b:
        raise ValueError("paged_decode_attention takes one long position and one block table row per query row")
    slopes = alibi_slopes if alibi_mode != 0 else positions  # unread without ALiBi
    pdl = programmatic_launches(q.device)
    _paged_attn_kernel[(b, nkv, splits)](
        q, k_cache, v_cache, block_tables, positions, out, m, l_, acc, counters, slopes, b,
        q.stride(0), q.stride(1), block_tables.stride(0), out.stride(0), out.stride(1), scale, alibi_scale,
        pages_per_split, unsplit_pages, G=group, GP=gp, NKV=nkv, D=d, PAGE=page, S=splits,
        GC=max(2, triton.next_power_of_2(group)), ALIBI=alibi_mode, EARLY=early, PDL=pdl, RELEASE=release, num_warps=4,
        num_stages=2,
        launch_pdl=pdl,
    )  # fmt: skip
    return out


# ---------------------------------------------------------------------------------------------- SiLU gate


@triton.jit
def _silu_mul_kernel(gu_ptr, out_ptr, stride_gu, stride_o, n_cols, out_scale, BLOCK: tl.constexpr,
                     SCALED: tl.constexpr):  # fmt: skip
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_cols
    g = tl.load(gu_ptr + row * stride_gu + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + row * stride_gu + n_cols + offs, mask=mask, other=0.0).to(tl.float32)
    y = g / (1.0 + tl.exp(-g)) * u
    _store_out(out_ptr + row * stride_o + offs, y, mask, out_scale, SCALED, gu_ptr.dtype.element_ty)


def silu_mul(gate_up: torch.Tensor, f16_scale: float | None = None) -> torch.Tensor:
    """gate_up [N, 2I] -> silu(gate) * up [N, I] in gate_up's dtype; with `f16_scale`: that result times f16_scale,
    rounded to fp16 (the NF4 streaming GEMV's prescaled input)."""
    n, two_i = gate_up.shape
    inter = two_i // 2
    out = _scaled_output(gate_up, (n, inter), f16_scale)
    block = 1024
    _silu_mul_kernel[(n, triton.cdiv(inter, block))](
        gate_up, out, gate_up.stride(0), out.stride(0), inter, f16_scale or 1.0, BLOCK=block,
        SCALED=f16_scale is not None, num_warps=4,
    )  # fmt: skip
    return out


# ---------------------------------------------------------------------------------------------- skinny GEMM

PROLOGUE_NONE, PROLOGUE_RMSNORM, PROLOGUE_SILU = 0, 1, 2


@triton.jit
def _skinny_gemm_kernel(
    x_ptr,
    w_ptr,
    res_ptr,
    out_ptr,
    nw_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_rm,
    stride_om,
    eps,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    M_P: tl.constexpr,
    HAS_RES: tl.constexpr,
    PROLOGUE: tl.constexpr,
):
    # out[M, N] = f(x)[M, K] @ w[N, K]^T (+ res[M, N]); each program streams BLOCK_N weight rows once.
    # f: identity; RMSNorm with weight nw[K] (each program recomputes the row statistics, x is tiny);
    # or SiLU-gating of x[M, 2K] = [gate | up].
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, M_P)
    n_mask = offs_n < N
    m_mask = offs_m < M
    dt = w_ptr.dtype.element_ty
    if PROLOGUE == 1:
        ss = tl.zeros([M_P], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            xm = m_mask[:, None] & (offs_k < K)[None, :]
            xs = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :], mask=xm, other=0.0).to(tl.float32)
            ss += tl.sum(xs * xs, axis=1)
        rstd = 1.0 / tl.sqrt(ss / K + eps)
    acc = tl.zeros([M_P, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        w = tl.load(
            w_ptr + offs_n[:, None] * stride_wn + offs_k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0
        )
        xm = m_mask[:, None] & k_mask[None, :]
        x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]
        if PROLOGUE == 2:
            g = tl.load(x_ptrs, mask=xm, other=0.0).to(tl.float32)
            u = tl.load(x_ptrs + K, mask=xm, other=0.0).to(tl.float32)
            x = ((g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32) * u).to(dt)  # rounded as the reference MLP
        elif PROLOGUE == 1:
            xs = tl.load(x_ptrs, mask=xm, other=0.0).to(tl.float32)
            nw = tl.load(nw_ptr + offs_k, mask=k_mask, other=0.0).to(tl.float32)
            x = ((xs * rstd[:, None]).to(dt).to(tl.float32) * nw[None, :]).to(dt)  # rounded as the reference norm
        else:
            x = tl.load(x_ptrs, mask=xm, other=0.0)
        if M_P >= 16:
            acc += tl.dot(x.to(dt), tl.trans(w))
        else:
            acc += tl.sum(x[:, None, :].to(tl.float32) * w[None, :, :].to(tl.float32), axis=2)
    mask = m_mask[:, None] & n_mask[None, :]
    if HAS_RES:
        acc += tl.load(res_ptr + offs_m[:, None] * stride_rm + offs_n[None, :], mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)


# (BLOCK_N, BLOCK_K, num_warps, num_stages) candidates, chosen per projection by timing on the device
SKINNY_GEMM_CONFIGS: tuple[tuple[int, int, int, int], ...] = (
    (16, 256, 4, 4),
    (32, 128, 4, 4),
    (8, 512, 4, 3),
    (16, 512, 8, 3),
    (32, 256, 8, 3),
)


def skinny_gemm(
    x: torch.Tensor,
    weight: torch.Tensor,
    residual: torch.Tensor | None,
    config: tuple[int, int, int, int],
    *,
    prologue: int = PROLOGUE_NONE,
    norm_weight: torch.Tensor | None = None,
    eps: float = 0.0,
) -> torch.Tensor:
    """f(x) [M, K] (M <= 16) @ weight[N, K]^T (+ residual [M, N]) -> [M, N] in the weight's dtype, where f is the
    identity, RMSNorm with `norm_weight`, or SiLU gating of x [M, 2K]."""
    m = x.shape[0]
    n, k = weight.shape
    block_n, block_k, warps, stages = config
    out = torch.empty((m, n), dtype=weight.dtype, device=x.device)
    m_p = 1 if m == 1 else max(16, triton.next_power_of_2(m))
    res = residual if residual is not None else out
    nw = norm_weight if norm_weight is not None else weight
    _skinny_gemm_kernel[(triton.cdiv(n, block_n),)](
        x, weight, res, out, nw, m, n, k,
        x.stride(0), weight.stride(0), res.stride(0), out.stride(0), eps,
        BLOCK_N=block_n, BLOCK_K=block_k, M_P=m_p, HAS_RES=residual is not None, PROLOGUE=prologue,
        num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out


@triton.jit
def _splitk_gemv_kernel(
    x_ptr,
    w_ptr,
    nw_ptr,
    ws_ptr,
    N,
    K,
    stride_wn,
    eps,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT: tl.constexpr,
    PROLOGUE: tl.constexpr,
):
    # ws[split, N] = f(x)[k-range of this split] @ w[N, k-range]^T for one input row (x [K] or [2K] for SiLU)
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    dt = w_ptr.dtype.element_ty
    if PROLOGUE == 1:
        ss = tl.zeros([BLOCK_K], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs = k0 + tl.arange(0, BLOCK_K)
            xs = tl.load(x_ptr + offs, mask=offs < K, other=0.0).to(tl.float32)
            ss += xs * xs
        rstd = 1.0 / tl.sqrt(tl.sum(ss, axis=0) / K + eps)
    k_per = tl.cdiv(K, SPLIT)
    k_start = split * k_per
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k0 in range(k_start, k_start + k_per, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = (offs_k < K) & (offs_k < k_start + k_per)
        w = tl.load(
            w_ptr + offs_n[:, None] * stride_wn + offs_k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0
        )
        if PROLOGUE == 2:
            g = tl.load(x_ptr + offs_k, mask=k_mask, other=0.0).to(tl.float32)
            u = tl.load(x_ptr + K + offs_k, mask=k_mask, other=0.0).to(tl.float32)
            x = ((g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32) * u).to(dt).to(tl.float32)
        elif PROLOGUE == 1:
            xs = tl.load(x_ptr + offs_k, mask=k_mask, other=0.0).to(tl.float32)
            nw = tl.load(nw_ptr + offs_k, mask=k_mask, other=0.0).to(tl.float32)
            x = ((xs * rstd).to(dt).to(tl.float32) * nw).to(dt).to(tl.float32)
        else:
            x = tl.load(x_ptr + offs_k, mask=k_mask, other=0.0).to(tl.float32)
        acc += tl.sum(w.to(tl.float32) * x[None, :], axis=1)
    tl.store(ws_ptr + split * N + offs_n, acc, mask=n_mask)


@triton.jit
def _splitk_reduce_kernel(ws_ptr, res_ptr, out_ptr, N, SPLIT: tl.constexpr, HAS_RES: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in range(SPLIT):
        acc += tl.load(ws_ptr + s * N + offs, mask=mask, other=0.0)
    if HAS_RES:
        acc += tl.load(res_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


# ("splitk", BLOCK_N, BLOCK_K, num_warps, splits) candidates for one input row
SPLITK_CONFIGS: tuple[tuple, ...] = (
    ("splitk", 32, 256, 4, 2),
    ("splitk", 32, 256, 4, 4),
    ("splitk", 64, 128, 4, 4),
    ("splitk", 16, 512, 4, 4),
    ("splitk", 32, 128, 4, 8),
)


def splitk_gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    residual: torch.Tensor | None,
    config: tuple,
    *,
    prologue: int = PROLOGUE_NONE,
    norm_weight: torch.Tensor | None = None,
    eps: float = 0.0,
) -> torch.Tensor:
    """Like `skinny_gemm` for one input row, with K split over `splits` programs per output block (more programs
    in flight for small weights) and a second kernel summing the fp32 partials (+ residual)."""
    _, block_n, block_k, warps, splits = config
    n, k = weight.shape
    ws = torch.empty((splits, n), dtype=torch.float32, device=x.device)
    nw = norm_weight if norm_weight is not None else weight
    _splitk_gemv_kernel[(triton.cdiv(n, block_n), splits)](
        x, weight, nw, ws, n, k, weight.stride(0), eps,
        BLOCK_N=block_n, BLOCK_K=block_k, SPLIT=splits, PROLOGUE=prologue, num_warps=warps, num_stages=3,
    )  # fmt: skip
    out = torch.empty((1, n), dtype=weight.dtype, device=x.device)
    res = residual if residual is not None else out
    _splitk_reduce_kernel[(triton.cdiv(n, 1024),)](
        ws, res, out, n, SPLIT=splits, HAS_RES=residual is not None, BLOCK=1024, num_warps=4
    )
    return out
