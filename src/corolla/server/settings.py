"""What a server derives from its config and the model config before it joins the swarm (`resolve_settings`):
dtype, DHT prefix, how many blocks, token limits and the KV cache budget per block; logged at start
(`describe_settings`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from corolla.models.config import default_dht_prefix
from corolla.protocol.uids import validate_dht_prefix
from corolla.server import sizing, startup_checks
from corolla.server.config import ServerConfig


@dataclass
class ResolvedSettings:
    """What the server derived from its config and the model config (logged at start)."""

    device: torch.device
    dtype: torch.dtype
    quant_type: str
    dht_prefix: str
    total_blocks: int
    num_blocks: int
    hidden_size: int
    inference_max_length_tokens: int
    max_batch_size_tokens: int
    attn_cache_tokens: int
    kv_bytes_per_token_block: int  # K or V of one token in one block (the announced cache_tokens_left unit)
    cache_bytes_per_block: int


def resolve_settings(
    config: ServerConfig, model_config: Any, device: torch.device, quant_type: str
) -> ResolvedSettings:
    """Derives the settings; without --num_blocks / --block_indices, as many blocks as device memory holds."""

    mc = model_config
    dtype = startup_checks.resolve_dtype(mc, config.torch_dtype, device)
    dht_prefix = validate_dht_prefix(config.dht_prefix or default_dht_prefix(config.model_name_or_path, mc))
    total_blocks = int(mc.num_hidden_layers)
    attn_cache_tokens = config.attn_cache_tokens or sizing.default_attn_cache_tokens(mc)
    kv_bytes = sizing.kv_bytes_per_token_block(mc, dtype)
    if config.block_indices is not None:
        start, end = config.block_indices
        if end > total_blocks:
            raise ValueError(f"block_indices {start}:{end} go past the model's {total_blocks} blocks")
        num_blocks = end - start
    elif config.num_blocks is not None:
        num_blocks = min(config.num_blocks, total_blocks)
    else:
        num_blocks = _choose_num_blocks(config, mc, device, dtype, quant_type, attn_cache_tokens)
    return ResolvedSettings(
        device=device,
        dtype=dtype,
        quant_type=quant_type,
        dht_prefix=dht_prefix,
        total_blocks=total_blocks,
        num_blocks=num_blocks,
        hidden_size=int(mc.hidden_size),
        inference_max_length_tokens=config.inference_max_length_tokens or sizing.default_length_limit_tokens(mc),
        max_batch_size_tokens=config.max_batch_size_tokens or sizing.default_length_limit_tokens(mc),
        attn_cache_tokens=attn_cache_tokens,
        kv_bytes_per_token_block=kv_bytes,
        cache_bytes_per_block=sizing.cache_bytes_per_block(mc, dtype, attn_cache_tokens),
    )


def _choose_num_blocks(
    c: ServerConfig, model_config: Any, device: torch.device, dtype: torch.dtype, quant_type: str, cache_tokens: int
) -> int:
    adapter_bytes = sizing.adapter_bytes_per_block(
        c.adapters, dtype=dtype, model_config=model_config, cache_dir=c.cache_dir, revision=c.revision, token=c.token
    )
    return int(
        sizing.choose_num_blocks(
            model_config, device=device, dtype=dtype, quant_type=quant_type,
            cache_bytes_per_block=sizing.cache_bytes_per_block(model_config, dtype, cache_tokens),
            adapter_bytes_per_block=adapter_bytes,
            tensor_parallel_devices=[torch.device(d) for d in c.tensor_parallel_devices or ()],
        )
    )  # fmt: skip


def describe_settings(s: ResolvedSettings, config: ServerConfig) -> str:
    return (
        f"device={s.device}, dtype={str(s.dtype).removeprefix('torch.')}, quant={s.quant_type}, "
        f"blocks={config.block_indices or s.num_blocks} of {s.total_blocks}, prefix={s.dht_prefix}, "
        f"cache={s.cache_bytes_per_block * s.num_blocks / 2**20:.1f} MiB ({s.attn_cache_tokens} tokens/block), "
        f"inference_max_length={s.inference_max_length_tokens}, max_batch_size={s.max_batch_size_tokens}"
    )
