"""Memory sizing of blocks: parameter bytes per quantization type (reference 6.1) and KV bytes per token."""

from __future__ import annotations

import torch

from corolla.models.kv_sizing import kv_cache_bytes_per_token as kv_bytes_per_token_of_architecture
from corolla.models.moe_sizing import largest_block_params
from corolla.models.quantization import BYTES_PER_VALUE, QuantType

SIZE_MARGIN = 0.01  # the reference's 1% slack


def count_block_parameters(config) -> int:
    """Parameters of one block (the largest: a routed-experts one when the model mixes dense and MoE layers),
    counted on the meta device (no memory is used)."""
    return largest_block_params(config)


def block_size_bytes(config, dtype: torch.dtype, quant_type: QuantType | str = QuantType.NONE) -> int:
    """Bytes one block takes in device memory: parameters x bytes per value (dtype size, 1 for int8, 4.25/8 for
    nf4), plus 1%."""
    quant_type = QuantType.parse(quant_type)
    if quant_type == QuantType.NONE:
        bytes_per_value = torch.empty((), dtype=dtype).element_size()
    else:
        bytes_per_value = BYTES_PER_VALUE[quant_type]
    return round(count_block_parameters(config) * bytes_per_value * (1 + SIZE_MARGIN))


def kv_cache_bytes_per_token(config, dtype: torch.dtype) -> int:
    """K and V bytes one token takes in one block's cache (all shards together; MLA: latent + rotary key)."""
    return kv_bytes_per_token_of_architecture(config, dtype)
