"""KV cache bytes per token per block, from the architecture: K + V of the cached heads for standard attention,
the compressed latent + shared rotary key for multi-head latent attention (DeepSeek-V3). The server logs this
number at start-up and sizes its cache with it."""

from __future__ import annotations

from typing import Any

import torch

from corolla.models.registry import get_family


def kv_cache_values_per_token(config: Any) -> int:
    """Values one token takes in one block's KV cache (all tensor-parallel shards together)."""
    family = get_family(config)
    if family.cache_values_per_token is not None:
        return int(family.cache_values_per_token(config))
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
    return 2 * int(family.num_kv_heads(config)) * head_dim


def kv_cache_bytes_per_token(config: Any, dtype: torch.dtype) -> int:
    """Bytes one token takes in one block's KV cache in `dtype`."""
    return kv_cache_values_per_token(config) * dtype.itemsize
