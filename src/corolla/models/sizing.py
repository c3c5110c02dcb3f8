"""Memory sizing of blocks: parameter bytes per quantization type (reference 6.1) and KV bytes per token, from the
architecture: K + V of the cached heads for standard attention, the compressed latent + shared rotary key for
multi-head latent attention (DeepSeek-V3). The server logs the KV figure at start-up and sizes its cache with it.
Every routed expert's bytes sit in the server's memory (routing stays inside the block: no expert traffic between
servers), so a mixture-of-experts block counts all of them."""

from __future__ import annotations

from typing import Any

import torch

from corolla.models.llama.block import head_dim_of
from corolla.models.quantization import BYTES_PER_VALUE, QuantType
from corolla.models.registry import get_family

SIZE_MARGIN = 0.01  # the reference's 1% slack


def representative_layers(config: Any) -> dict[bool, int]:
    """{is_sparse: the first layer of that kind}: one dense and/or one sparse layer stand for all of them."""
    family = get_family(config)
    kinds: dict[bool, int] = {}
    for i in range(int(config.num_hidden_layers)):
        sparse = family.is_sparse_layer(config, i) if family.is_sparse_layer is not None else False
        kinds.setdefault(sparse, i)
        if len(kinds) == 2:
            break
    return kinds


def _layer_parameters(config: Any, layer_idx: int) -> int:
    with torch.device("meta"):
        block = get_family(config).build_block(config, layer_idx)
    return sum(p.numel() for p in block.parameters())


def count_block_parameters(config: Any) -> int:
    """Parameters of one block (the largest: a routed-experts one when the model mixes dense and MoE layers), for
    per-block memory sizing; counted on the meta device (no memory is used)."""
    return max(_layer_parameters(config, i) for i in representative_layers(config).values())


def block_size_bytes(config, dtype: torch.dtype, quant_type: QuantType | str = QuantType.NONE) -> int:
    """Bytes one block takes in device memory: parameters x bytes per value (dtype size, 1 for int8, 4.25/8 for
    nf4), plus 1%."""
    quant_type = QuantType.parse(quant_type)
    bytes_per_value: float
    if quant_type == QuantType.NONE:
        bytes_per_value = torch.empty((), dtype=dtype).element_size()
    else:
        bytes_per_value = BYTES_PER_VALUE[quant_type]
    return round(count_block_parameters(config) * bytes_per_value * (1 + SIZE_MARGIN))


def kv_cache_values_per_token(config: Any) -> int:
    """Values one token takes in one block's KV cache (all tensor-parallel shards together)."""
    family = get_family(config)
    if family.cache_values_per_token is not None:
        return int(family.cache_values_per_token(config))
    return 2 * int(family.num_kv_heads(config)) * int(head_dim_of(config))


def kv_cache_bytes_per_token(config: Any, dtype: torch.dtype) -> int:
    """K and V bytes one token takes in one block's cache in `dtype` (all shards together; MLA: latent + rotary
    key)."""
    return kv_cache_values_per_token(config) * dtype.itemsize
