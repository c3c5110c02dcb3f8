"""Loading a server's span: each block's own tensors from the checkpoint, then tensor-parallel split, quantization
(per shard, after the split: quantized weights cannot be sliced) and the pre-loaded LoRA adapters, in that order."""

from __future__ import annotations

from typing import Any

import torch

from corolla.server.config import ServerConfig


def load_span_blocks(
    config: ServerConfig,
    model_config: Any,
    block_indices: range,
    *,
    dtype: torch.dtype,
    device: torch.device,
    quant_type: str,
) -> dict[int, Any]:
    """Returns {block index: block} on `device` (or on the tensor-parallel devices), ready to serve."""
    from corolla.models.loading import load_pretrained_block

    c = config
    tensor_parallel = bool(c.tensor_parallel_devices) and len(c.tensor_parallel_devices) > 1
    blocks = {}
    for index in block_indices:
        block = load_pretrained_block(
            c.model_name_or_path,
            index,
            config=model_config,
            torch_dtype=dtype,
            cache_dir=c.cache_dir,
            revision=c.revision,
            token=c.token,
            max_disk_space_bytes=c.max_disk_space_bytes,
        )
        if tensor_parallel:
            from corolla.models.tensor_parallel import make_tensor_parallel

            block = make_tensor_parallel(block, [torch.device(d) for d in c.tensor_parallel_devices])
        if quant_type != "none":
            from corolla.models.quantization import quantize_block

            block = quantize_block(block, quant_type, device)
        elif not tensor_parallel:
            block = block.to(device)
        for adapter in c.adapters:
            from corolla.models.lora import add_adapter, load_adapter

            weights = load_adapter(
                adapter, index, cache_dir=c.cache_dir, revision=c.revision, token=c.token,
                max_disk_space_bytes=c.max_disk_space_bytes,
            )  # fmt: skip
            add_adapter(block, adapter, weights)
        blocks[index] = block
    return blocks
