"""A rotary decode step's attention in one Triton kernel (`rope_paged_decode_attention`): the rotary embedding of the
queries and of the new keys, the new keys' and values' write into the paged cache and the paged decode attention,
split over the sequence like `triton_kernels.paged_decode_attention` (the splits combined by the last program of each
(row, kv head)). It replaces that pair's two kernels (`triton_kernels.rope_and_store`, then the attention) in the
Llama-style spans' decode step of up to `ops.decode_ops.FUSED_ATTENTION_MAX_ROWS` rows (docs/decisions/0110).

Programmatic dependent launch (sm_90+): each program first reads only what no kernel of the step writes (the
positions, the block tables, the rotary tables and its first page of cached keys and values: earlier steps wrote
them), releases the next kernel, then waits for the kernel ahead (the qkv projection) before it reads qkv. Its first
page's loads so overlap the projection's tail instead of following it.

The keys and values this call writes (each row's position) reach the attention from qkv, not through the cache: a
row's mates are the rows whose new key lies in its own sequence at or before its position (itself, and the rows of a
short step before it: T rows of one sequence at consecutive positions attend to each other), found by their
position's page in the row's table; on a page within the call's row count of the row's position, each token at a
mate's new slot takes the mate's rotated key and value instead of the cache's (its score from the key, its value's
share through the value: one-hot products on the matrix units), and the program over the row's own position stores
its key and value into the cache for later steps. So no program waits for another's write, and the result is
`rope_and_store` then the attention over the written cache (the new keys' scores to 2^-17 of themselves).
Importing fails without Triton."""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from corolla.engine.kernels.attention_counters import attention_counters
from corolla.engine.kernels.triton_kernels import finish_attention


@triton.jit
def _rotate(x, partner, c, s, first_half):
    # rotate-half RoPE in fp32 as rope_and_store forms it: x c - x' s in the first half of the dims, x c + x' s in
    # the second (x' the value D/2 away)
    return tl.where(first_half, x * c - partner * s, x * c + partner * s)


@triton.jit
def _attend_page(q, k, v, m_i, l_i, acc, p, page_id, pos, window, mate_slots, new_k, new_v, scale,
                 PAGE: tl.constexpr, RP: tl.constexpr):  # fmt: skip
    # one page (k, v [PAGE, D] as loaded from the cache) into the online softmax of q [GP, D]. On a page that may
    # hold keys of this call, each token at a mate row's new slot (mate_slots [RP], -1 for the other rows) takes
    # that row's key and value (new_k, new_v [RP, D]) instead of the cache's: its score from new_k, its value's
    # share through new_v (one-hot products over the rows: exact selections)
    offs_t = tl.arange(0, PAGE)
    key_pos = p * PAGE + offs_t  # [PAGE]
    s = tl.dot(q, tl.trans(k)) * scale  # [GP, PAGE]
    one = tl.zeros([PAGE, RP], dtype=new_v.dtype)
    mixed = p * PAGE + PAGE > window
    if mixed:
        hit = (page_id * PAGE + offs_t)[:, None] == mate_slots[None, :]  # [PAGE, RP]: at most one mate per token
        new = tl.max(hit.to(tl.int32), axis=1) > 0  # [PAGE]
        one = hit.to(new_v.dtype)
        s_new = tl.dot(q, tl.trans(new_k)) * scale  # [GP, RP] fp32
        # to the tokens through the matrix units in two 16-bit parts (the score to 2^-17 of itself)
        hi = s_new.to(new_v.dtype)
        lo = (s_new - hi.to(tl.float32)).to(new_v.dtype)
        s = tl.where(new[None, :], tl.dot(hi, tl.trans(one)) + tl.dot(lo, tl.trans(one)), s)
        v = tl.where(new[:, None], tl.zeros_like(v), v)  # (the cache's stale value there may be anything)
    s = tl.where((key_pos <= pos)[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp(m_i - m_new)
    probs = tl.exp(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(probs, axis=1)
    acc = acc * alpha[:, None] + tl.dot(probs.to(v.dtype), v)
    if mixed:  # the new tokens' probabilities (rounded as above, then selected exactly) times their values
        acc += tl.dot(tl.dot(probs.to(v.dtype), one).to(v.dtype), new_v)
    return m_new, l_i, acc


@triton.jit
def _rope_attn_kernel(
    qkv_ptr,
    cos_ptr,
    sin_ptr,
    pos_ptr,
    k_ptr,
    v_ptr,
    bt_ptr,
    out_ptr,
    m_ptr,
    l_ptr,
    acc_ptr,
    cnt_ptr,
    n_rows,
    stride_qkv,
    stride_bt,
    stride_ob,
    stride_oh,
    scale,
    G: tl.constexpr,
    GP: tl.constexpr,
    NQ: tl.constexpr,
    NKV: tl.constexpr,
    D: tl.constexpr,
    PAGE: tl.constexpr,
    S: tl.constexpr,
    SP: tl.constexpr,
    GC: tl.constexpr,
    RP: tl.constexpr,
    PDL: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    HALF: tl.constexpr = D // 2
    offs_g = tl.arange(0, GP)
    offs_d = tl.arange(0, D)
    offs_t = tl.arange(0, PAGE)
    g_mask = offs_g < G
    # what no kernel of this step writes, read before the wait: positions, tables, the cache's earlier tokens
    pos = tl.load(pos_ptr + b).to(tl.int64)
    n_pages = (pos // PAGE + 1).to(tl.int32)
    per_split = tl.cdiv(n_pages, S)
    p_start = split * per_split
    p_end = tl.minimum(p_start + per_split, n_pages)
    window = pos - n_rows + 1  # the earliest position whose key this call may write in this row's sequence
    # the mate rows: those whose new key lies in this row's sequence at or before its position (itself, and a short
    # step's rows before it), found by their position's page in this row's table
    offs_r = tl.arange(0, RP)
    pos_r = tl.load(pos_ptr + offs_r, mask=offs_r < n_rows, other=-1).to(tl.int64)  # [RP]
    near = (offs_r < n_rows) & (pos_r <= pos) & (pos_r >= window)
    page_r = tl.load(bt_ptr + offs_r * stride_bt + pos_r // PAGE, mask=near, other=-1).to(tl.int64)
    seq_page = tl.load(bt_ptr + b * stride_bt + pos_r // PAGE, mask=near, other=-2).to(tl.int64)
    mate = near & (page_r == seq_page)
    mate_slots = tl.where(mate, page_r * PAGE + pos_r % PAGE, -1)  # [RP]
    trig_r = pos_r[:, None] * HALF + (offs_d % HALF)[None, :]  # [RP, D]
    c_r = tl.load(cos_ptr + trig_r, mask=mate[:, None], other=0.0)
    s_r = tl.load(sin_ptr + trig_r, mask=mate[:, None], other=0.0)
    first = tl.where(p_start < p_end, PAGE, 0)  # the first page's tokens, none for an empty split
    page0 = tl.load(bt_ptr + b * stride_bt + p_start, mask=first > 0, other=0).to(tl.int64)
    tile0 = page0 * (PAGE * NKV * D) + kvh * D + offs_t[:, None] * (NKV * D) + offs_d[None, :]  # [PAGE, D]
    k0 = tl.load(k_ptr + tile0, mask=(offs_t < first)[:, None], other=0.0)
    v0 = tl.load(v_ptr + tile0, mask=(offs_t < first)[:, None], other=0.0)
    trig = pos * HALF + offs_d % HALF  # [D]
    c_q = tl.load(cos_ptr + trig)
    s_q = tl.load(sin_ptr + trig)
    if PDL:
        gdc_launch_dependents()  # the next kernel may start its programs (it waits before reading our output)
        gdc_wait()  # the kernel ahead (qkv's projection) complete, its writes visible
    q_row = qkv_ptr + b * stride_qkv + (kvh * G + offs_g)[:, None] * D  # [GP, 1]
    qx = tl.load(q_row + offs_d[None, :], mask=g_mask[:, None], other=0.0)  # [GP, D]
    qp = tl.load(q_row + ((offs_d + HALF) % D)[None, :], mask=g_mask[:, None], other=0.0)
    q = _rotate(qx.to(tl.float32), qp.to(tl.float32), c_q[None, :], s_q[None, :], (offs_d < HALF)[None, :])
    q = q.to(qx.dtype)  # rounded as rope_and_store stores the rotated queries
    # the mate rows' new keys (rotated, rounded as rope_and_store stores them) and values [RP, D], zeros elsewhere
    mates = qkv_ptr + offs_r.to(tl.int64)[:, None] * stride_qkv + kvh * D  # [RP, 1]
    kx = tl.load(mates + NQ * D + offs_d[None, :], mask=mate[:, None], other=0.0)
    kp = tl.load(mates + NQ * D + ((offs_d + HALF) % D)[None, :], mask=mate[:, None], other=0.0)
    new_k = _rotate(kx.to(tl.float32), kp.to(tl.float32), c_r, s_r, (offs_d < HALF)[None, :]).to(kx.dtype)
    new_v = tl.load(mates + (NQ + NKV) * D + offs_d[None, :], mask=mate[:, None], other=0.0)
    if (p_start <= pos // PAGE) & (pos // PAGE < p_end):  # the program over the row's own position stores its key
        own = qkv_ptr + b * stride_qkv + (NQ + kvh) * D
        kx_own = tl.load(own + offs_d).to(tl.float32)
        kp_own = tl.load(own + (offs_d + HALF) % D).to(tl.float32)
        k_own = _rotate(kx_own, kp_own, c_q, s_q, offs_d < HALF).to(k_ptr.dtype.element_ty)
        slot = tl.load(bt_ptr + b * stride_bt + pos // PAGE).to(tl.int64) * PAGE + pos % PAGE
        tl.store(k_ptr + slot * (NKV * D) + kvh * D + offs_d, k_own)
        tl.store(v_ptr + slot * (NKV * D) + kvh * D + offs_d, tl.load(own + NKV * D + offs_d))
    m_i = tl.full([GP], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([GP], dtype=tl.float32)
    acc = tl.zeros([GP, D], dtype=tl.float32)
    if first > 0:
        m_i, l_i, acc = _attend_page(q, k0, v0, m_i, l_i, acc, p_start, page0, pos, window, mate_slots, new_k,
                                     new_v, scale, PAGE, RP)  # fmt: skip
    for p in range(p_start + 1, p_end):
        page_id = tl.load(bt_ptr + b * stride_bt + p).to(tl.int64)
        tile = page_id * (PAGE * NKV * D) + kvh * D + offs_t[:, None] * (NKV * D) + offs_d[None, :]
        k = tl.load(k_ptr + tile)  # [PAGE, D]
        v = tl.load(v_ptr + tile)
        m_i, l_i, acc = _attend_page(q, k, v, m_i, l_i, acc, p, page_id, pos, window, mate_slots, new_k, new_v,
                                     scale, PAGE, RP)  # fmt: skip
    finish_attention(out_ptr, m_ptr, l_ptr, acc_ptr, cnt_ptr, m_i, l_i, acc, b, kvh, split, stride_ob, stride_oh,
                     G, GP, NKV, D, S, SP, GC)  # fmt: skip


def programmatic(device: torch.device) -> bool:
    """Whether launches on `device` are programmatic dependent launches (a compiled kernel on sm_90+)."""
    return (
        device.type == "cuda"
        and os.environ.get("TRITON_INTERPRET") != "1"
        and (torch.cuda.get_device_capability(device)[0] >= 9)
    )


# fmt: off
def rope_paged_decode_attention(
    qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor, k_cache: torch.Tensor,
    v_cache: torch.Tensor, block_tables: torch.Tensor, scale: float, splits: int, num_heads: int, num_kv_heads: int,
) -> torch.Tensor:
    # fmt: on
    """qkv [B, (nq + 2 nkv) D] (contiguous rows); cos/sin [P, D/2] float32; positions [B] long; caches [pages, page,
    nkv, D]; block_tables [B, maxp] int32 (each row's pages; its position's page its own). Writes each row's rotated
    key and its value at its position's slot and returns the attention of its rotated queries over its tokens up to
    and including that position [B, nq, D]: `ops.rope_and_store_ref` then `ops.paged_decode_attention_ref` with
    seq_lens = positions + 1. `splits` programs share each (row, kv head) (`attention_counters`)."""
    b = qkv.shape[0]
    page, nkv, d = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    if nkv != num_kv_heads or qkv.shape[1] != (num_heads + 2 * nkv) * d or qkv.stride(1) != 1:
        raise ValueError(f"qkv {tuple(qkv.shape)} does not hold {num_heads} + 2 x {nkv} heads of {d} for the cache")
    group = num_heads // nkv
    gp = max(16, triton.next_power_of_2(group))
    out = torch.empty((b, num_heads, d), dtype=qkv.dtype, device=qkv.device)
    if splits > 1:
        counters = attention_counters(qkv.device, b * nkv)
        m = torch.empty((b, nkv, splits, gp), dtype=torch.float32, device=qkv.device)
        l_ = torch.empty_like(m)
        acc = torch.empty((b, nkv, splits, gp, d), dtype=torch.float32, device=qkv.device)
    else:
        m = l_ = acc = counters = out  # unused
    pdl = programmatic(qkv.device)
    launch = {"launch_pdl": True} if pdl else {}
    _rope_attn_kernel[(b, nkv, splits)](
        qkv, cos, sin, positions, k_cache, v_cache, block_tables, out, m, l_, acc, counters,
        b, qkv.stride(0), block_tables.stride(0), out.stride(0), out.stride(1), scale,
        G=group, GP=gp, NQ=num_heads, NKV=nkv, D=d, PAGE=page, S=splits, SP=triton.next_power_of_2(splits),
        GC=max(2, triton.next_power_of_2(group)), RP=max(16, triton.next_power_of_2(b)), PDL=pdl, num_warps=4,
        num_stages=2, **launch,
    )  # fmt: skip
    return out
