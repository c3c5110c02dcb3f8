"""Causal attention of a prefill chunk over its sequence's whole history: the chunk's T queries are the last T of
the L positions whose keys and values it attends to.

The chunk that follows a reused prefix (issue 34's next turn: 132 queries over ~4,100 cached positions) or an earlier
chunk used to pass an explicit boolean [T, L] mask, which rules out torch's flash kernel; with grouped K/V heads it
also ruled out the memory-efficient one, so every layer ran the math fallback (K/V repeated per head, fp32 scores).
A lower-right causal bias (`torch.nn.attention.bias.causal_lower_right`) says the same thing without a mask: on CUDA
torch runs flash attention (GQA included) or the memory-efficient kernel with its lower-right mask type (a value
head size unlike the key's, as in MLA), elsewhere it materializes the mask (docs/decisions/0017)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right


def causal_prefill_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float, enable_gqa: bool = False
) -> torch.Tensor:
    """q [1, nq, T, Dk] at the last T of the L positions of k [1, nkv, L, Dk] and v [1, nkv, L, Dv] (T <= L); each
    query attends to every position up to its own. Returns [1, nq, T, Dv]."""
    t, total = q.shape[2], k.shape[2]
    if t > total:
        raise ValueError(f"a chunk of {t} queries attends to at least its own {t} positions, got {total}")
    if t == total:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=enable_gqa)
    bias = causal_lower_right(t, total)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scale, enable_gqa=enable_gqa)
