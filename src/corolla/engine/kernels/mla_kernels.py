"""The non-GEMM operations of the DeepSeek-V3 fast path, all CUDA-graph safe (static shapes, no host sync):
`rope_rotate` (DeepSeek's interleaved pairs or rotate-half, math in fp32; the llama family's reference rotation too,
`ops.decode_ops.rope_and_store_ref`), `store_latent` (the token's latent and
rotary key into the paged pool), `paged_latent_attention` (absorbed decode attention: queries already in the latent
space score against cached latents + rotary keys, the output stays in the latent space). (The router with group-limited
top-k is the blocks' own: `models.deepseek_v3.moe.group_limited_route`.)"""

from __future__ import annotations

import torch


def rope_rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, interleaved: bool) -> torch.Tensor:
    """x [N, n, r]; cos/sin [N, r/2] fp32 (one angle per pair). Interleaved: the pairs are (2i, 2i+1) and the output
    is de-interleaved to [evens | odds] (as the plain block and transformers do, for queries and keys alike);
    otherwise rotate-half. Returns [N, n, r] in x's dtype."""
    xf = x.float()
    half = x.shape[-1] // 2
    if interleaved:
        a, b = xf[..., 0::2], xf[..., 1::2]  # [N, n, r/2] each
    else:
        a, b = xf[..., :half], xf[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]  # [N, 1, r/2]
    return torch.cat((a * c - b * s, b * c + a * s), dim=-1).to(x.dtype)


def store_latent(
    latent: torch.Tensor,
    k_rope: torch.Tensor,
    slots: torch.Tensor,
    latent_cache: torch.Tensor,
    rope_cache: torch.Tensor,
) -> None:
    """latent [N, c], k_rope [N, r] written at flat cache `slots` [N] long of latent_cache [pages, page, 1, c] and
    rope_cache [pages, page, 1, r]."""
    latent_cache.view(-1, latent.shape[-1]).index_copy_(0, slots, latent.to(latent_cache.dtype))
    rope_cache.view(-1, k_rope.shape[-1]).index_copy_(0, slots, k_rope.to(rope_cache.dtype))


def paged_latent_attention(
    q_latent: torch.Tensor,
    q_rope: torch.Tensor,
    latent_cache: torch.Tensor,
    rope_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Absorbed MLA decode attention (the torch reference). q_latent [B, n, c] (q_nope through kv_b's key half),
    q_rope [B, n, r]; latent_cache [pages, page, 1, c], rope_cache [pages, page, 1, r]; block_tables [B, maxp]
    int32; seq_lens [B] int32 (>= 1): row b attends to its first seq_lens[b] tokens. score = (q_latent . c +
    q_rope . k_rope) * scale; returns sum_j p_j c_j [B, n, c] in q's dtype (scores and softmax in fp32; entries
    past a row's length are zeroed, whatever their page holds). Reads the latents once for all heads; never forms
    per-head keys or values. Outside CUDA-graph capture it gathers only the pages up to the longest row (bounded by
    the real lengths); under capture all `maxp` (graphs use `mla_triton.paged_latent_attention`, which reads only
    each row's real tokens)."""
    b, n, c = q_latent.shape
    r = q_rope.shape[-1]
    tables = block_tables.long()
    if not _capturing(q_latent.device):  # gather only the pages the longest row uses (one host sync)
        page = latent_cache.shape[1]
        tables = tables[:, : max(1, -(-int(seq_lens.max()) // page))]  # [B, used pages]
    valid = torch.arange(tables.shape[1] * latent_cache.shape[1], device=q_latent.device)[None, :]
    valid = valid < seq_lens[:, None].long()  # [B, L] with L = pages * page
    lat = latent_cache[tables].reshape(b, -1, c).float().masked_fill(~valid[..., None], 0.0)  # [B, L, c]
    rope = rope_cache[tables].reshape(b, -1, r).float().masked_fill(~valid[..., None], 0.0)  # [B, L, r]
    scores = torch.baddbmm(
        torch.bmm(q_rope.float(), rope.transpose(1, 2)), q_latent.float(), lat.transpose(1, 2)
    )  # [B, n, L]
    scores = (scores * scale).masked_fill(~valid[:, None, :], float("-inf"))
    probs = scores.softmax(dim=-1)  # [B, n, L] fp32
    return torch.bmm(probs, lat).to(q_latent.dtype)  # [B, n, c]


def _capturing(device: torch.device) -> bool:
    """Whether a CUDA graph is being captured on `device` (no host sync allowed; shapes must stay static)."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()
