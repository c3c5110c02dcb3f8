"""Triton kernels of the DeepSeek-V3 decode step (importing fails without Triton; `mla_kernels` holds the torch
reference of each):

- `rope_norm_store`: one launch per layer step for the query's rotary part (rotated, de-interleaved when DeepSeek's
  interleaved pairs are used) and the token's cache entry (the latent RMS-normed, the shared rotary key rotated,
  both written at the token's slot of the paged pool);
- `paged_latent_attention`: absorbed MLA decode attention over the paged latent cache. One program per (row, block
  of heads, split of the row's REAL tokens): scores q_latent . latent + q_rope . rope_key, online softmax in fp32,
  out = sum p * latent; a combine kernel merges the splits. The grid is static (CUDA-graph safe) but each program
  reads only the tokens below its row's seq_len, so time and memory follow the real lengths, not the pool's
  `max_pages_per_seq`."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from corolla.engine.kernels.triton_kernels import combine_splits

HEADS_PER_PROGRAM = 16  # tl.dot needs >= 16 rows; every program re-reads its tokens' latents (L2 absorbs it)
TOKENS_PER_BLOCK = 16  # tokens per inner iteration (any page size: each token's page is looked up on its own)

# ---------------------------------------------------------------------------------------------- rope + norm + store


@triton.jit
def _rope_norm_store_kernel(
    q_ptr,
    kv_ptr,
    norm_ptr,
    cos_ptr,
    sin_ptr,
    pos_ptr,
    slot_ptr,
    q_rope_ptr,
    lat_cache_ptr,
    rope_cache_ptr,
    stride_qn,
    stride_qh,
    stride_kv,
    eps,
    NH: tl.constexpr,
    NOPE: tl.constexpr,
    C: tl.constexpr,
    CP: tl.constexpr,
    R: tl.constexpr,
    HALF_P: tl.constexpr,
    BH: tl.constexpr,
    INTERLEAVED: tl.constexpr,
):
    row = tl.program_id(0)
    blk = tl.program_id(1)  # 0: the token's cache entry; 1..: blocks of BH query heads
    HALF: tl.constexpr = R // 2
    offs_i = tl.arange(0, HALF_P)
    i_mask = offs_i < HALF
    pos = tl.load(pos_ptr + row).to(tl.int64)
    cos = tl.load(cos_ptr + pos * HALF + offs_i, mask=i_mask, other=0.0)  # [HALF_P] fp32
    sin = tl.load(sin_ptr + pos * HALF + offs_i, mask=i_mask, other=0.0)
    if INTERLEAVED:
        ia = 2 * offs_i
        ib = 2 * offs_i + 1
    else:
        ia = offs_i
        ib = offs_i + HALF
    if blk == 0:
        slot = tl.load(slot_ptr + row).to(tl.int64)
        offs_c = tl.arange(0, CP)
        c_mask = offs_c < C
        x = tl.load(kv_ptr + row * stride_kv + offs_c, mask=c_mask, other=0.0)  # [CP]
        xf = x.to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / C + eps)
        w = tl.load(norm_ptr + offs_c, mask=c_mask, other=0.0)
        y = (xf * rstd).to(w.dtype) * w  # rounded before scaling, as the reference norm does
        tl.store(lat_cache_ptr + slot * C + offs_c, y.to(lat_cache_ptr.dtype.element_ty), mask=c_mask)
        ka = tl.load(kv_ptr + row * stride_kv + C + ia, mask=i_mask, other=0.0)  # [HALF_P]
        kb = tl.load(kv_ptr + row * stride_kv + C + ib, mask=i_mask, other=0.0)
        kaf = ka.to(tl.float32)
        kbf = kb.to(tl.float32)
        k_dst = rope_cache_ptr + slot * R + offs_i
        tl.store(k_dst, (kaf * cos - kbf * sin).to(ka.dtype).to(rope_cache_ptr.dtype.element_ty), mask=i_mask)
        tl.store(k_dst + HALF, (kbf * cos + kaf * sin).to(ka.dtype).to(rope_cache_ptr.dtype.element_ty), mask=i_mask)
    else:
        heads = (blk - 1) * BH + tl.arange(0, BH)
        m = (heads < NH)[:, None] & i_mask[None, :]  # [BH, HALF_P]
        src = q_ptr + row * stride_qn + heads[:, None] * stride_qh + NOPE
        qa = tl.load(src + ia[None, :], mask=m, other=0.0).to(tl.float32)  # [BH, HALF_P]
        qb = tl.load(src + ib[None, :], mask=m, other=0.0).to(tl.float32)
        q_dst = q_rope_ptr + (row * NH + heads)[:, None] * R + offs_i[None, :]
        tl.store(q_dst, (qa * cos[None, :] - qb * sin[None, :]).to(q_rope_ptr.dtype.element_ty), mask=m)
        tl.store(q_dst + HALF, (qb * cos[None, :] + qa * sin[None, :]).to(q_rope_ptr.dtype.element_ty), mask=m)


def rope_norm_store(
    q: torch.Tensor,
    kv: torch.Tensor,
    norm_weight: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor,
    latent_cache: torch.Tensor,
    rope_cache: torch.Tensor,
    *,
    nope: int,
    eps: float,
    interleaved: bool,
) -> torch.Tensor:
    """q [N, n, nope + r] (last dim contiguous), kv [N, c + r] (kv_a's output); cos/sin [P, r/2] fp32; positions
    [N], slots [N] long. Writes rmsnorm(kv[:, :c]) * norm_weight and the rotated kv[:, c:] at `slots` of
    latent_cache [pages, page, 1, c] / rope_cache [pages, page, 1, r]; returns the rotated q[..., nope:] [N, n, r]
    contiguous (same contract as `mla_kernels.rope_rotate` + `ops.rms_norm` + `store_latent`)."""
    n_rows, n_heads, _ = q.shape
    c, r = latent_cache.shape[-1], rope_cache.shape[-1]
    if kv.shape != (n_rows, c + r) or kv.stride(1) != 1 or q.stride(2) != 1:
        raise ValueError(f"kv must be [{n_rows}, {c + r}] and q, kv last-dim contiguous")
    if not (latent_cache.is_contiguous() and rope_cache.is_contiguous()):
        raise ValueError("the latent and rotary-key caches must be contiguous")
    q_rope = torch.empty((n_rows, n_heads, r), dtype=q.dtype, device=q.device)  # [N, n, r]
    grid = (n_rows, 1 + triton.cdiv(n_heads, HEADS_PER_PROGRAM))
    _rope_norm_store_kernel[grid](
        q, kv, norm_weight, cos, sin, positions, slots, q_rope, latent_cache, rope_cache,
        q.stride(0), q.stride(1), kv.stride(0), eps,
        NH=n_heads, NOPE=nope, C=c, CP=triton.next_power_of_2(c), R=r, HALF_P=triton.next_power_of_2(r // 2),
        BH=HEADS_PER_PROGRAM, INTERLEAVED=interleaved, num_warps=4,
    )  # fmt: skip
    return q_rope


# ---------------------------------------------------------------------------------------------- attention


@triton.jit
def _latent_attn_kernel(
    ql_ptr,
    qr_ptr,
    lat_ptr,
    rope_ptr,
    bt_ptr,
    lens_ptr,
    out_ptr,
    m_ptr,
    l_ptr,
    acc_ptr,
    stride_qlb,
    stride_qlh,
    stride_qrb,
    stride_qrh,
    stride_bt,
    stride_ob,
    stride_oh,
    scale,
    NH: tl.constexpr,
    C: tl.constexpr,
    CP: tl.constexpr,
    R: tl.constexpr,
    RP: tl.constexpr,
    PAGE: tl.constexpr,
    BH: tl.constexpr,
    BT: tl.constexpr,
    S: tl.constexpr,
):
    b = tl.program_id(0)
    hb = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(lens_ptr + b)
    n_blocks = tl.cdiv(seq_len, BT)
    per_split = tl.cdiv(n_blocks, S)
    blk_start = split * per_split
    blk_end = tl.minimum(blk_start + per_split, n_blocks)

    heads = hb * BH + tl.arange(0, BH)
    h_mask = heads < NH
    offs_c = tl.arange(0, CP)
    offs_r = tl.arange(0, RP)
    offs_t = tl.arange(0, BT)
    c_mask = offs_c < C
    r_mask = offs_r < R
    ql = tl.load(
        ql_ptr + b * stride_qlb + heads[:, None] * stride_qlh + offs_c[None, :],
        mask=h_mask[:, None] & c_mask[None, :],
        other=0.0,
    )  # [BH, CP]
    qr = tl.load(
        qr_ptr + b * stride_qrb + heads[:, None] * stride_qrh + offs_r[None, :],
        mask=h_mask[:, None] & r_mask[None, :],
        other=0.0,
    )  # [BH, RP]
    m_i = tl.full([BH], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BH], dtype=tl.float32)
    acc = tl.zeros([BH, CP], dtype=tl.float32)
    for blk in range(blk_start, blk_end):
        tok = blk * BT + offs_t  # [BT]
        valid = tok < seq_len
        page = tl.load(bt_ptr + b * stride_bt + tok // PAGE, mask=valid, other=0).to(tl.int64)
        slot = page * PAGE + tok % PAGE  # [BT]
        lat = tl.load(
            lat_ptr + slot[:, None] * C + offs_c[None, :], mask=valid[:, None] & c_mask[None, :], other=0.0
        )  # [BT, CP]
        rk = tl.load(
            rope_ptr + slot[:, None] * R + offs_r[None, :], mask=valid[:, None] & r_mask[None, :], other=0.0
        )  # [BT, RP]
        s = (tl.dot(ql, tl.trans(lat)) + tl.dot(qr, tl.trans(rk))) * scale  # [BH, BT] fp32
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])  # [BH, BT]
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(lat.dtype), lat)  # [BH, CP]
        m_i = m_new
    if S == 1:
        out = acc / l_i[:, None]
        dst = out_ptr + b * stride_ob + heads[:, None] * stride_oh + offs_c[None, :]
        tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=h_mask[:, None] & c_mask[None, :])
    else:
        part = (b * NH + heads) * S + split  # scratch layout [B, NH, S(, CP)]
        tl.store(m_ptr + part, m_i, mask=h_mask)
        tl.store(l_ptr + part, l_i, mask=h_mask)
        tl.store(acc_ptr + part[:, None] * CP + offs_c[None, :], acc, mask=h_mask[:, None])


@triton.jit
def _latent_combine_kernel(
    m_ptr,
    l_ptr,
    acc_ptr,
    out_ptr,
    stride_ob,
    stride_oh,
    NH: tl.constexpr,
    C: tl.constexpr,
    CP: tl.constexpr,
    BH: tl.constexpr,
    S: tl.constexpr,
):
    b = tl.program_id(0)
    heads = tl.program_id(1) * BH + tl.arange(0, BH)
    h_mask = heads < NH
    offs_c = tl.arange(0, CP)
    first = (b * NH + heads) * S  # [BH]: split 0's scratch rows
    out = combine_splits(m_ptr, l_ptr, acc_ptr, first, 1, h_mask, offs_c, S, BH, CP, S)  # [BH, CP]
    dst = out_ptr + b * stride_ob + heads[:, None] * stride_oh + offs_c[None, :]
    tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=h_mask[:, None] & (offs_c < C)[None, :])


def paged_latent_attention(
    q_latent: torch.Tensor,
    q_rope: torch.Tensor,
    latent_cache: torch.Tensor,
    rope_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    splits: int,
) -> torch.Tensor:
    """Same contract as `mla_kernels.paged_latent_attention`; `splits` programs share each (row, block of heads),
    each over its part of the row's first seq_lens[b] tokens. Scratch: [B, n, splits, c] fp32 when splits > 1."""
    b, n_heads, c = q_latent.shape
    r = q_rope.shape[-1]
    page = latent_cache.shape[1]
    if not (latent_cache.is_contiguous() and rope_cache.is_contiguous()):
        raise ValueError("the latent and rotary-key caches must be contiguous")
    if q_latent.stride(2) != 1 or q_rope.stride(2) != 1 or block_tables.stride(1) != 1:
        raise ValueError("q_latent, q_rope and block_tables must be contiguous in their last dimension")
    cp, rp = max(16, triton.next_power_of_2(c)), max(16, triton.next_power_of_2(r))
    out = torch.empty((b, n_heads, c), dtype=q_latent.dtype, device=q_latent.device)  # [B, n, c]
    if splits > 1:
        m = torch.empty((b, n_heads, splits), dtype=torch.float32, device=q_latent.device)
        l_ = torch.empty_like(m)
        acc = torch.empty((b, n_heads, splits, cp), dtype=torch.float32, device=q_latent.device)
    else:
        m = l_ = acc = out  # unused
    head_blocks = triton.cdiv(n_heads, HEADS_PER_PROGRAM)
    _latent_attn_kernel[(b, head_blocks, splits)](
        q_latent, q_rope, latent_cache, rope_cache, block_tables, seq_lens, out, m, l_, acc,
        q_latent.stride(0), q_latent.stride(1), q_rope.stride(0), q_rope.stride(1), block_tables.stride(0),
        out.stride(0), out.stride(1), scale,
        NH=n_heads, C=c, CP=cp, R=r, RP=rp, PAGE=page, BH=HEADS_PER_PROGRAM, BT=TOKENS_PER_BLOCK, S=splits,
        num_warps=4, num_stages=2,
    )  # fmt: skip
    if splits > 1:
        _latent_combine_kernel[(b, head_blocks)](
            m, l_, acc, out, out.stride(0), out.stride(1),
            NH=n_heads, C=c, CP=cp, BH=HEADS_PER_PROGRAM, S=splits, num_warps=4,
        )  # fmt: skip
    return out
