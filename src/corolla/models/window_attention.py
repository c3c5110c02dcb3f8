"""Attention for the families with features `scaled_dot_product_attention` can't express (Gemma 2/3, gpt-oss):
logit soft-capping, per-head q/k RMSNorm, learned per-head sink logits, a custom score scale, and a bounded
ring-buffer KV cache for sliding-window layers.

Sliding-window cache rule. A sliding layer with window W only ever looks at the last W - 1 earlier keys, so its
cache holds `capacity = min(max_length, W + slack_tokens)` positions in a ring (position p in slot p % capacity),
plus a small int64 state `[batch, 2]` = (first position still held, end of the written prefix). A step at
`position` P needs the keys of positions [max(0, P - W + 1), P); it is served when they are all still held, which
is always the case for a rollback (`start_from_position`) of up to `slack_tokens + 1` tokens below the furthest
written position. A rollback further back is refused with a ValueError naming the limit (never wrong output).
Full-attention layers keep the usual `[B, kv_heads, max_length, head_dim]` K and V.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from corolla.models.attention import causal_mask, check_cache, full_cache_step, split_heads
from corolla.models.block_base import BlockAttention, TensorDescriptor
from corolla.models.positions import RotaryEmbedding

DEFAULT_SLIDING_SLACK_TOKENS = 64  # rollback room of a sliding layer's ring (speculative drafts are shorter)
STATE_FIELDS = 2  # (first held position, end of the written prefix)


@dataclass(frozen=True)
class WindowedAttentionConfig:
    """Shape and features of one attention layer. `scale` multiplies q.k (1/sqrt(head_dim) unless the family
    says otherwise); `sliding_window_tokens` None means full attention."""

    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    qkv_bias: bool = False
    out_bias: bool = False
    sliding_window_tokens: int | None = None
    logit_softcap: float | None = None
    sinks: bool = False
    sliding_slack_tokens: int = DEFAULT_SLIDING_SLACK_TOKENS


def sliding_cache_capacity(window_tokens: int, slack_tokens: int, max_length: int) -> int:
    """Positions a sliding layer's ring holds for a session of `max_length` tokens."""
    return min(max_length, window_tokens + slack_tokens)


class WindowedAttention(BlockAttention):
    """GQA attention with the extras above. q/k norms (`q_norm`, `k_norm`: modules over head_dim) run before
    the rotary embedding, as Gemma 3 does. Weights: fused `qkv` (rows `[q heads | k heads | v heads]`),
    `o_proj`, optional `sinks` [num_heads]."""

    def __init__(
        self,
        cfg: WindowedAttentionConfig,
        rotary: RotaryEmbedding,
        *,
        q_norm: nn.Module | None = None,
        k_norm: nn.Module | None = None,
    ):
        super().__init__()
        if cfg.num_heads % cfg.num_kv_heads != 0:
            raise ValueError(f"num_heads={cfg.num_heads} must be a multiple of num_kv_heads={cfg.num_kv_heads}")
        if cfg.sliding_window_tokens is not None and cfg.sliding_window_tokens < 1:
            raise ValueError(f"sliding_window_tokens must be >= 1, got {cfg.sliding_window_tokens}")
        if cfg.sliding_slack_tokens < 0:
            raise ValueError(f"sliding_slack_tokens must be >= 0, got {cfg.sliding_slack_tokens}")
        self.cfg = cfg
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.sliding_window = cfg.sliding_window_tokens
        self.slack_tokens = cfg.sliding_slack_tokens
        h, kv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.qkv = nn.Linear(cfg.hidden_size, (h + 2 * kv) * hd, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(h * hd, cfg.hidden_size, bias=cfg.out_bias)
        self.sinks = nn.Parameter(torch.zeros(h)) if cfg.sinks else None
        self.q_norm, self.k_norm = q_norm, k_norm
        self.rotary = rotary

    # ---- cache layout

    def cache_capacity(self, max_length: int) -> int:
        if self.sliding_window is None:
            return max_length
        return sliding_cache_capacity(self.sliding_window, self.slack_tokens, max_length)

    def cache_descriptors(self, batch_size: int, max_length: int, dtype: torch.dtype) -> list[TensorDescriptor]:
        """K, V `[B, kv_heads, capacity, head_dim]`; sliding layers add the ring state `[B, 2]` int64."""
        device = self.o_proj.weight.device
        shape = (batch_size, self.num_kv_heads, self.cache_capacity(max_length), self.head_dim)
        descriptors = [TensorDescriptor(shape, dtype, device), TensorDescriptor(shape, dtype, device)]
        if self.sliding_window is not None:
            descriptors.append(TensorDescriptor((batch_size, STATE_FIELDS), torch.int64, device))
        return descriptors

    # ---- forward

    def forward(self, x: torch.Tensor, cache: list[torch.Tensor] | None, position: int) -> torch.Tensor:
        B, T, _ = x.shape
        q, k, v = split_heads(self.qkv(x), self.num_heads, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary.apply(q, k, position)
        if cache is None:
            k_all, v_all, key_start = k, v, position
        elif self.sliding_window is None:
            k_all, v_all = full_cache_step(cache, k, v, position)  # [B, kv, P+T, hd]
            key_start = 0
        else:
            k_all, v_all, key_start = self._ring_cache_step(cache, k, v, position)
        out = self._attend(q, k_all, v_all, query_start=position, key_start=key_start)  # [B, h, T, hd]
        return self.o_proj(out.transpose(1, 2).reshape(B, T, self.num_heads * self.head_dim))  # [B, T, H]

    def _ring_cache_step(self, cache: list[torch.Tensor], k: torch.Tensor, v: torch.Tensor, position: int):
        """Reads the held keys this step needs, then writes the new ones into the ring. Returns K/V
        `[B, kv, n, hd]` for positions [key_start, position + T) and key_start."""
        T = k.shape[2]
        check_cache(cache, 3, k, v)
        k_ring, v_ring, state = cache  # [B, kv, C, hd] x2, [B, 2] int64
        window, capacity = int(self.sliding_window or 0), k_ring.shape[2]
        held_from, held_end = (int(value) for value in state[0].tolist())
        if position > held_end:
            raise ValueError(f"position {position} is past the {held_end} tokens this session's cache holds")
        need_from = max(0, position - window + 1)
        if need_from < held_from:
            raise ValueError(
                f"start position {position} needs the keys from position {need_from}, but this sliding-window "
                f"layer (window {window}, cache {capacity} tokens = window + {capacity - window} slack) only holds "
                f"positions [{held_from}, {held_end}): rollbacks of more than {capacity - window + 1} tokens "
                f"below the furthest position are not supported"
            )
        past_slots = torch.arange(need_from, position, device=k_ring.device) % capacity  # [P - need_from]
        k_all = torch.cat([k_ring.index_select(2, past_slots).to(k.dtype), k], dim=2)  # [B, kv, n, hd]
        v_all = torch.cat([v_ring.index_select(2, past_slots).to(v.dtype), v], dim=2)
        kept = min(T, capacity)  # a prompt longer than the ring leaves only its last `capacity` keys
        new_slots = torch.arange(position + T - kept, position + T, device=k_ring.device) % capacity  # [kept]
        k_ring.index_copy_(2, new_slots, k[:, :, T - kept :].to(k_ring.dtype))
        v_ring.index_copy_(2, new_slots, v[:, :, T - kept :].to(v_ring.dtype))
        end = position + T
        state[:, 0] = max(held_from, end - capacity)
        state[:, 1] = end
        return k_all, v_all, need_from

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, query_start: int, key_start: int):
        """q [B,h,T,hd], k/v [B,kv,S,hd]; query i sits at absolute position query_start+i, key j at key_start+j.
        Scores in fp32: scale, soft-cap, causal (and window) mask, sinks, softmax."""
        B, h, T, hd = q.shape
        kv, S = k.shape[1], k.shape[2]
        group = h // kv
        qg = q.reshape(B, kv, group, T, hd).float()  # [B, kv, g, T, hd]
        scores = torch.matmul(qg, k.float()[:, :, None].transpose(-1, -2)) * self.cfg.scale  # [B, kv, g, T, S]
        if self.cfg.logit_softcap is not None:
            scores = softcap(scores, float(self.cfg.logit_softcap))
        allowed, _ = causal_mask(query_start, T, key_start, S, self.sliding_window, q.device)  # [T, S]
        scores = scores.masked_fill(~allowed, float("-inf"))
        if self.sinks is not None:
            sink = self.sinks.float().reshape(1, kv, group, 1, 1).expand(B, kv, group, T, 1)  # [B, kv, g, T, 1]
            probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :S]  # sink column dropped
        else:
            probs = torch.softmax(scores, dim=-1)  # [B, kv, g, T, S]
        out = torch.matmul(probs.to(v.dtype), v[:, :, None])  # [B, kv, g, T, hd]
        return out.reshape(B, h, T, hd)


def softcap(x: torch.Tensor, cap: float) -> torch.Tensor:
    """cap * tanh(x / cap) (Gemma's logit soft-capping)."""
    return torch.tanh(x / cap) * cap
