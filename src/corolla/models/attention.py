"""Self-attention shared by all families: one fused q/k/v projection (rows `[q heads | k heads | v heads]`),
rotary or ALiBi positions, optional sliding window, our KV cache layout `[B, kv_heads, max_length, head_dim]`, and
`scaled_dot_product_attention`; or, for the features it can't express (Gemma 2/3, gpt-oss), scores in fp32 with
logit soft-capping, learned per-head sink logits and a custom scale.

Sliding-window ring (`ring_slack_tokens`, Gemma and gpt-oss). A sliding layer with window W only ever looks at the
last W - 1 earlier keys, so its cache holds `capacity = min(max_length, W + slack_tokens)` positions in a ring
(position p in slot p % capacity), plus a small int64 state `[batch, 2]` = (first position still held, end of the
written prefix). A step at `position` P needs the keys of positions [max(0, P - W + 1), P); it is served when they
are all still held, which is always the case for a rollback (`start_from_position`) of up to `slack_tokens + 1`
tokens below the furthest written position. A rollback further back is refused with a ValueError naming the limit
(never wrong output). Without a ring (Mistral, Qwen2, Phi-3) a sliding layer keeps the full cache and masks."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from corolla.models.block_base import BlockAttention, TensorDescriptor
from corolla.models.positions import RotaryEmbedding, alibi_slopes

DEFAULT_SLIDING_SLACK_TOKENS = 64  # rollback room of a sliding layer's ring (speculative drafts are shorter)
STATE_FIELDS = 2  # a ring's state: (first held position, end of the written prefix)


class Attention(BlockAttention):
    """Multi-head / grouped-query / multi-query attention over `num_heads` query heads and `num_kv_heads` KV heads.

    `head_ids` are the global ids of the query heads held here (all unless tensor parallel split them); they pick
    the ALiBi slopes. ALiBi bias is `slope * key_position * alibi_scale` (BLOOM: scale 1; Falcon: 1/sqrt(hd),
    with the slope-position product rounded to bf16 as Falcon does). `q_norm` / `k_norm` (Qwen3, Gemma 3): modules
    over head_dim applied to each head before rotary. `fp32_scores` (Gemma, gpt-oss): scores computed in fp32 and
    multiplied by `scale` (1/sqrt(head_dim) unless given), soft-capped at `logit_softcap`, with a learned sink logit
    per head (`sinks` [num_heads]) when `sinks`.
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        qkv_bias: bool,
        out_bias: bool,
        rotary: RotaryEmbedding | None = None,
        alibi: bool = False,
        alibi_scale: float = 1.0,
        alibi_bf16_product: bool = False,
        total_heads: int | None = None,
        sliding_window: int | None = None,
        q_norm: nn.Module | None = None,
        k_norm: nn.Module | None = None,
        fp32_scores: bool = False,
        scale: float | None = None,
        logit_softcap: float | None = None,
        sinks: bool = False,
        ring_slack_tokens: int | None = None,
    ):
        super().__init__()
        if num_heads % num_kv_heads != 0:
            raise ValueError(f"num_heads={num_heads} must be a multiple of num_kv_heads={num_kv_heads}")
        window_ok = sliding_window is None or sliding_window >= 1  # (None: a full layer, which keeps no ring)
        if ring_slack_tokens is not None and (ring_slack_tokens < 0 or not window_ok):
            raise ValueError(f"a ring needs a window >= 1 and slack >= 0, got {sliding_window}, {ring_slack_tokens}")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.hidden_size = hidden_size
        self.qkv = nn.Linear(hidden_size, (num_heads + 2 * num_kv_heads) * head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=out_bias)
        self.rotary = rotary
        self.alibi = alibi
        self.alibi_scale = alibi_scale
        self.alibi_bf16_product = alibi_bf16_product
        self.total_heads = total_heads or num_heads
        self.head_ids: list[int] = list(range(num_heads))
        self.sliding_window = sliding_window
        self.scale = scale if scale is not None else 1.0 / math.sqrt(head_dim)
        self.q_norm, self.k_norm = q_norm, k_norm
        self.fp32_scores = fp32_scores
        self.logit_softcap = logit_softcap
        self.sinks = nn.Parameter(torch.zeros(num_heads)) if sinks else None
        self.slack_tokens = ring_slack_tokens

    @property
    def ring(self) -> bool:
        """Whether the cache is a ring: only where the layer slides (a block's full layers keep the whole cache)."""
        return self.slack_tokens is not None and self.sliding_window is not None

    def cache_capacity(self, max_length: int) -> int:
        """Positions a layer's cache holds for a session of `max_length` tokens."""
        if not self.ring:
            return max_length
        return min(max_length, int(self.sliding_window or 0) + int(self.slack_tokens or 0))

    def cache_descriptors(self, batch_size: int, max_length: int, dtype: torch.dtype) -> list[TensorDescriptor]:
        """K and V, each `[batch, kv_heads, capacity, head_dim]` on this module's device; a ring adds its state
        `[batch, 2]` int64."""
        device = self.o_proj.weight.device
        shape = (batch_size, self.num_kv_heads, self.cache_capacity(max_length), self.head_dim)
        descriptors = [TensorDescriptor(shape, dtype, device), TensorDescriptor(shape, dtype, device)]
        if self.ring:
            descriptors.append(TensorDescriptor((batch_size, STATE_FIELDS), torch.int64, device))
        return descriptors

    def forward(self, x: torch.Tensor, cache: list[torch.Tensor] | None, position: int) -> torch.Tensor:
        B, T, _ = x.shape
        q, k, v = split_heads(self.qkv(x), self.num_heads, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)  # per head, over hd
        if self.rotary is not None:
            q, k = self.rotary.apply(q, k, position)
        if cache is None:
            k_all, v_all, key_start = k, v, position
        elif not self.ring:
            (k_all, v_all), key_start = full_cache_step(cache, k, v, position), 0  # [B, kv, P+T, hd]
        else:
            k_all, v_all, key_start = self._ring_cache_step(cache, k, v, position)
        attend = self._attend_fp32 if self.fp32_scores else self._attend
        out = attend(q, k_all, v_all, query_start=position, key_start=key_start)  # [B, h, T, hd]
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
        """q [B,h,T,hd], k/v [B,kv,S,hd]; query i sits at absolute position query_start+i, key j at key_start+j."""
        T, S = q.shape[-2], k.shape[-2]
        gqa = self.num_kv_heads != self.num_heads
        simple_causal = not self.alibi and (self.sliding_window is None or query_start + T <= self.sliding_window)
        if simple_causal and (T == 1 or query_start - key_start == S - T == 0):
            # One query sees every key; or a fresh square causal block.
            return F.scaled_dot_product_attention(q, k, v, is_causal=T > 1, scale=self.scale, enable_gqa=gqa)
        allowed, k_pos = causal_mask(query_start, T, key_start, S, self.sliding_window, q.device)  # [T, S], [S]
        if not self.alibi:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=self.scale, enable_gqa=gqa)
        slopes = alibi_slopes(self.total_heads).to(q.device)[self.head_ids]  # [h] fp32
        if self.alibi_bf16_product:
            bias = (slopes.bfloat16()[:, None] * k_pos[None, :]).to(q.dtype) * self.alibi_scale  # [h, S]
        else:
            bias = (slopes[:, None] * k_pos[None, :].float() * self.alibi_scale).to(q.dtype)  # [h, S]
        mask = bias[:, None, :].masked_fill(~allowed[None], float("-inf"))  # [h, T, S]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask[None], scale=self.scale, enable_gqa=gqa)

    def _attend_fp32(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, query_start: int, key_start: int):
        """`_attend` with scores in fp32: scale, soft-cap, causal (and window) mask, sinks, softmax."""
        B, h, T, hd = q.shape
        kv, S = k.shape[1], k.shape[2]
        group = h // kv
        qg = q.reshape(B, kv, group, T, hd).float()  # [B, kv, g, T, hd]
        scores = torch.matmul(qg, k.float()[:, :, None].transpose(-1, -2)) * self.scale  # [B, kv, g, T, S]
        if self.logit_softcap is not None:
            scores = softcap(scores, float(self.logit_softcap))
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


def split_heads(
    qkv: torch.Tensor, heads: int, kv_heads: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A fused projection's output [B, T, (h + 2 kv) hd] -> q [B, h, T, hd], k and v [B, kv, T, hd] (views)."""
    B, T, _ = qkv.shape
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q, k, v = (t.view(B, T, n, head_dim).transpose(1, 2) for t, n in ((q, heads), (k, kv_heads), (v, kv_heads)))
    return q, k, v


def check_cache(tensors: list[torch.Tensor], expected: int, *new: torch.Tensor) -> None:
    """ValueError unless a layer's cache is `expected` tensors whose first ones ([B, heads, L, dim]: K, V; MLA's
    latent and rotary key) fit the step's `new` ones [B, heads, T, dim] in batch, heads and dim."""
    if len(tensors) != expected:
        raise ValueError(f"expected {expected} cache tensors for this layer, got {len(tensors)}")
    for held, step in zip(tensors, new, strict=False):
        (B, heads, _, dim), shape = step.shape, tuple(held.shape)
        if shape[0] != B or shape[1] != heads or shape[3] != dim:
            raise ValueError(f"cache shape {shape} does not fit batch {B}, {heads} heads, {dim} dims")


def full_cache_step(
    cache: list[torch.Tensor], k: torch.Tensor, v: torch.Tensor, position: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Writes this step's k, v [B, kv, T, hd] at [position, position + T) of a full cache (K, V [B, kv, L, hd]; MLA:
    latent and rotary key) and returns the keys and values of positions [0, position + T) in their dtype."""
    check_cache(cache, 2, k, v)
    (k_cache, v_cache), T = cache, k.shape[2]
    if position + T > k_cache.shape[2]:
        raise ValueError(f"position {position} + {T} tokens exceeds the cache length {k_cache.shape[2]}")
    k_cache[:, :, position : position + T] = k.to(k_cache.dtype)
    v_cache[:, :, position : position + T] = v.to(v_cache.dtype)
    return k_cache[:, :, : position + T].to(k.dtype), v_cache[:, :, : position + T].to(v.dtype)


def interleaved_qkv_rows(num_heads: int, head_dim: int) -> torch.Tensor:
    """Row map for checkpoints fusing q/k/v per head (`[head, (q|k|v), head_dim]`, BLOOM and old Falcon):
    checkpoint row i goes to our row `result[i]` in the `[q heads | k heads | v heads]` layout."""
    h = torch.arange(num_heads)[:, None, None]  # [h, 1, 1]
    t = torch.arange(3)[None, :, None]  # [1, 3, 1]
    d = torch.arange(head_dim)[None, None, :]  # [1, 1, hd]
    return ((t * num_heads + h) * head_dim + d).reshape(-1)  # [3 h hd]


def grouped_qkv_rows(num_heads: int, num_kv_heads: int, head_dim: int) -> torch.Tensor:
    """Row map for Falcon's new decoder architecture: per KV group g the checkpoint holds its `group` query
    heads, then its key, then its value (`[kv, group + 2, head_dim]`)."""
    group = num_heads // num_kv_heads
    rows = []
    for g in range(num_kv_heads):
        heads = [g * group + j for j in range(group)] + [num_heads + g, num_heads + num_kv_heads + g]
        for our_head in heads:
            rows.append(torch.arange(our_head * head_dim, (our_head + 1) * head_dim))
    return torch.cat(rows)  # [(h + 2 kv) hd]


def causal_mask(
    query_start: int, num_queries: int, key_start: int, num_keys: int, window: int | None, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """(allowed [T, S] bool: key position <= query position, and within `window` of it when given; the key
    positions [S])."""
    q_pos = torch.arange(query_start, query_start + num_queries, device=device)  # [T]
    k_pos = torch.arange(key_start, key_start + num_keys, device=device)  # [S]
    allowed = k_pos[None, :] <= q_pos[:, None]  # [T, S]
    if window is not None:
        allowed &= k_pos[None, :] > q_pos[:, None] - window
    return allowed, k_pos
