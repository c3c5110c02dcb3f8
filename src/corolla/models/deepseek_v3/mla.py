"""Multi-head latent attention (DeepSeek-V2/V3). Per token the layer computes a latent `c` of `kv_lora_rank`
channels (RMS-normalized) and one rotary key `k_rope` of `qk_rope_head_dim` channels shared by all heads; the KV
cache holds exactly these two, `[B, 1, max_length, kv_lora_rank]` and `[B, 1, max_length, qk_rope_head_dim]`
(not per-head K/V). Each step expands the cached latents to per-head keys `[k_nope | k_rope]` and values with
`kv_b_proj` (correct first; absorbing `kv_b_proj` into q and o is a GPU optimization left to the fast path).
Queries come from `q_a_proj -> q_a_layernorm -> q_b_proj` (or one `q_proj` when `q_lora_rank` is None)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from corolla.models.attention import causal_mask, full_cache_step
from corolla.models.block_base import BlockAttention, TensorDescriptor
from corolla.models.layers import RMSNorm
from corolla.models.positions import RotaryEmbedding, rope_parameters

LATENT_NORM_EPS = 1e-6  # transformers builds q_a_layernorm / kv_a_layernorm with the default eps


def mla_softmax_scale(config) -> float:
    """qk_head_dim^-1/2, times mscale^2 under YaRN with `mscale_all_dim` (as DeepSeek's reference does)."""
    scale = 1.0 / math.sqrt(int(config.qk_nope_head_dim) + int(config.qk_rope_head_dim))
    params = rope_parameters(config)
    mscale_all_dim = float(params.get("mscale_all_dim", 0) or 0)
    factor = float(params.get("factor", 1.0) or 1.0)
    if params["rope_type"] != "default" and mscale_all_dim and factor > 1:
        mscale = 0.1 * mscale_all_dim * math.log(factor) + 1.0
        scale *= mscale * mscale
    return scale


def latent_cache_dims(config) -> tuple[int, int]:
    """(kv_lora_rank, qk_rope_head_dim): the channels one token takes in one MLA layer's cache."""
    return int(config.kv_lora_rank), int(config.qk_rope_head_dim)


class LatentAttention(BlockAttention):
    """MLA over `num_attention_heads` heads; forward(x [B,T,H], cache, position) -> [B,T,H] like `Attention`."""

    def __init__(self, config):
        super().__init__()
        self.hidden_size = int(config.hidden_size)
        self.num_heads = int(config.num_attention_heads)
        self.q_lora_rank: int | None = None if config.q_lora_rank is None else int(config.q_lora_rank)
        self.kv_lora_rank, self.rope_dim = latent_cache_dims(config)
        self.nope_dim = int(config.qk_nope_head_dim)
        self.v_dim = int(config.v_head_dim)
        self.qk_dim = self.nope_dim + self.rope_dim
        self.interleaved = bool(getattr(config, "rope_interleave", False))
        bias = bool(getattr(config, "attention_bias", False))
        h = self.num_heads
        self.q_proj: nn.Linear | None = None
        self.q_a_proj: nn.Linear | None = None
        self.q_a_layernorm: RMSNorm | None = None
        self.q_b_proj: nn.Linear | None = None
        if self.q_lora_rank is None:
            self.q_proj = nn.Linear(self.hidden_size, h * self.qk_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(self.hidden_size, self.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(self.q_lora_rank, h * self.qk_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(self.hidden_size, self.kv_lora_rank + self.rope_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(self.kv_lora_rank, h * (self.nope_dim + self.v_dim), bias=False)
        self.o_proj = nn.Linear(h * self.v_dim, self.hidden_size, bias=bias)
        self.rotary = RotaryEmbedding(self.rope_dim, rope_parameters(config), int(config.max_position_embeddings))
        self.scale = mla_softmax_scale(config)

    def cache_descriptors(self, batch_size: int, max_length: int, dtype: torch.dtype) -> list[TensorDescriptor]:
        """The latent `[B, 1, max_length, kv_lora_rank]` and the shared rotary key `[B, 1, max_length, rope_dim]`."""
        device = self.o_proj.weight.device
        return [
            TensorDescriptor((batch_size, 1, max_length, self.kv_lora_rank), dtype, device),
            TensorDescriptor((batch_size, 1, max_length, self.rope_dim), dtype, device),
        ]

    def _rotate(self, x: torch.Tensor, position: int) -> torch.Tensor:
        """x [B, n, T, rope_dim] rotated by absolute positions; DeepSeek's interleaved pairs or rotate-half."""
        cos, sin = self.rotary.cos_sin(position, x.shape[-2], x.device, x.dtype)  # [T, rope_dim]
        if self.interleaved:
            half = cos.shape[-1] // 2
            c, s = cos[:, :half], sin[:, :half]  # [T, rope_dim/2]: one angle per (even, odd) pair
            even, odd = x[..., 0::2], x[..., 1::2]
            return torch.cat((even * c - odd * s, odd * c + even * s), dim=-1)
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin

    def forward(self, x: torch.Tensor, cache: list[torch.Tensor] | None, position: int) -> torch.Tensor:
        B, T, _ = x.shape
        h = self.num_heads
        if self.q_proj is not None:
            q = self.q_proj(x)  # [B, T, h qk]
        else:
            assert self.q_a_proj is not None and self.q_a_layernorm is not None and self.q_b_proj is not None
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))  # [B, T, h qk]
        q = q.view(B, T, h, self.qk_dim).transpose(1, 2)  # [B, h, T, qk]
        q_nope, q_rope = q.split([self.nope_dim, self.rope_dim], dim=-1)
        latent, k_rope = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        latent = self.kv_a_layernorm(latent).view(B, 1, T, self.kv_lora_rank)  # [B, 1, T, c]
        k_rope = k_rope.reshape(B, 1, T, self.rope_dim)  # [B, 1, T, r]
        q_rope, k_rope = self._rotate(q_rope, position), self._rotate(k_rope, position)

        key_start = position if cache is None else 0
        if cache is not None:  # [B, 1, S, c], [B, 1, S, r] with S = P + T
            latent, k_rope = full_cache_step(cache, latent, k_rope, position)
        S = latent.shape[2]
        kv = self.kv_b_proj(latent[:, 0]).view(B, S, h, self.nope_dim + self.v_dim).transpose(1, 2)  # [B,h,S,n+v]
        k_nope, v = kv.split([self.nope_dim, self.v_dim], dim=-1)  # [B,h,S,n], [B,h,S,v]
        k = torch.cat((k_nope, k_rope.expand(B, h, S, self.rope_dim)), dim=-1)  # [B, h, S, qk]
        q = torch.cat((q_nope, q_rope), dim=-1)  # [B, h, T, qk]
        out = self._attend(q, k, v, query_start=position, key_start=key_start)  # [B, h, T, v]
        return self.o_proj(out.transpose(1, 2).reshape(B, T, h * self.v_dim))

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, query_start: int, key_start: int):
        """Causal attention; query i at absolute position query_start+i, key j at key_start+j."""
        T, S = q.shape[-2], k.shape[-2]
        if T == 1 or query_start - key_start == S - T == 0:
            return F.scaled_dot_product_attention(q, k, v, is_causal=T > 1, scale=self.scale)
        allowed, _ = causal_mask(query_start, T, key_start, S, None, q.device)  # [T, S]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=self.scale)
