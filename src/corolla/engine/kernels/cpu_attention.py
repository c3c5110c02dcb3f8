"""Paged decode attention for the CPU (the engine's eager path where no Triton kernel runs): the rows gather only
the pages their longest row uses and attend in one call of torch's fused CPU attention.

`ops.paged_decode_attention_ref` (the reference every kernel is tested against) gathers every row's whole block
table (sized for the engine's longest sequence), masks what lies past each row's length and attends in float32
einsums: right, but on a CPU server its cost grows with rows x table length; with 16 merged rows it cost more than
the step's projections. Rows shorter than the longest are masked, their gathered keys and values zeroed first so
that a recycled page's garbage (even NaN) can't reach the output. The result equals the reference within float
rounding (`tests/unit/test_engine_cpu_attention.py`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from corolla.engine.kernels.alibi import Alibi


def paged_decode_attention_cpu(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    alibi: Alibi | None = None,
) -> torch.Tensor:
    """Same contract as `ops.paged_decode_attention_ref`, for CPU tensors: q [B, nq, D]; caches [pages, page, nkv, D];
    block_tables [B, maxp] int32; seq_lens [B] (>= 1). Returns [B, nq, D] in q's dtype."""
    b, nq, d = q.shape
    page, nkv = k_cache.shape[1], k_cache.shape[2]
    lengths = seq_lens.tolist()  # on the CPU: no device sync
    if b == 0:
        return torch.empty_like(q)
    longest = max(lengths)
    tables = block_tables[:, : -(-longest // page)].long()  # [B, pages of the longest row]
    k_all = k_cache[tables].view(b, -1, nkv, d)  # [B, L, nkv, D]
    v_all = v_cache[tables].view(b, -1, nkv, d)
    if min(lengths) == longest:  # every row as long as the longest: nothing to mask
        k, v, mask = k_all[:, :longest], v_all[:, :longest], None
    else:
        valid = torch.arange(k_all.shape[1])[None, :] < seq_lens[:, None].long()  # [B, L]
        past = ~valid[:, :, None, None]  # [B, L, 1, 1]
        k_all.masked_fill_(past, 0.0)  # fresh copies: garbage past a row's length (NaN in a recycled page) must
        v_all.masked_fill_(past, 0.0)  # not reach a score (masking adds -inf to it) nor the weighted sum
        k, v, mask = k_all, v_all, valid[:, None, None, :]  # [B, 1, 1, L]
    if alibi is not None:
        bias = alibi.bias(torch.arange(k.shape[1]))[None, :, None, :]  # [1, nq, 1, L] fp32
        mask = bias if mask is None else bias.masked_fill(~mask, float("-inf"))  # [B, nq, 1, L]
    qf, kf, vf = q.float(), k.float(), v.float()  # float32 as the reference (no copy for a float32 engine)
    o = F.scaled_dot_product_attention(
        qf[:, :, None, :], kf.transpose(1, 2), vf.transpose(1, 2), attn_mask=mask, scale=scale, enable_gqa=nq != nkv
    )  # [B, nq, 1, D]
    return o[:, :, 0, :].to(q.dtype)
