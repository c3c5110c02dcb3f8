"""KV cache bytes of sliding-window families (Gemma 2/3, gpt-oss), from the architecture alone: full-attention
layers hold every position (K + V = 2 * kv_heads * head_dim values per token), sliding layers a ring of
`min(max_length, window + slack)` positions plus their 16-byte-per-sequence ring state (see `window_attention`).
The per-token figure the server logs (`kv_sizing.kv_cache_bytes_per_token`) is the full layers' one; this module
says what a session really reserves, layer by layer."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from corolla.models.gemma.block import sliding_window_of
from corolla.models.kv_sizing import kv_cache_bytes_per_token
from corolla.models.window_attention import DEFAULT_SLIDING_SLACK_TOKENS, STATE_FIELDS, sliding_cache_capacity

STATE_BYTES_PER_SEQUENCE = STATE_FIELDS * torch.int64.itemsize  # the ring's (first held, end) positions


def kv_cache_bytes(
    config: Any,
    layer_idx: int,
    dtype: torch.dtype,
    *,
    batch_size: int,
    max_length: int,
    slack_tokens: int = DEFAULT_SLIDING_SLACK_TOKENS,
) -> int:
    """Bytes one session of `batch_size` x `max_length` tokens reserves in layer `layer_idx`'s cache."""
    if batch_size < 1 or max_length < 1:
        raise ValueError(f"batch_size and max_length must be >= 1, got {batch_size}, {max_length}")
    per_token = kv_cache_bytes_per_token(config, dtype)
    window = sliding_window_of(config, layer_idx)
    if window is None:
        return batch_size * max_length * per_token
    held = sliding_cache_capacity(window, slack_tokens, max_length)
    return batch_size * (held * per_token + STATE_BYTES_PER_SEQUENCE)


def span_kv_cache_bytes(
    config: Any, block_indices: Sequence[int], dtype: torch.dtype, *, batch_size: int, max_length: int
) -> int:
    """`kv_cache_bytes` summed over a span (what the blocks' own contiguous caches take for one session of it)."""
    return sum(kv_cache_bytes(config, i, dtype, batch_size=batch_size, max_length=max_length) for i in block_indices)


def describe_kv_cache(config: Any, dtype: torch.dtype, slack_tokens: int = DEFAULT_SLIDING_SLACK_TOKENS) -> str:
    """One log-friendly line: per-token bytes and how many layers are capped at which length."""
    num_layers = int(config.num_hidden_layers)
    windows = [sliding_window_of(config, i) for i in range(num_layers)]
    sliding = [w for w in windows if w is not None]
    text = f"{kv_cache_bytes_per_token(config, dtype)} KV bytes/token/block"
    if sliding:
        text += f"; {len(sliding)} of {num_layers} sliding layers hold at most {max(sliding) + slack_tokens} tokens"
    return text
