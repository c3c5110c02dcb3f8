"""Loading a server's span: each block's own tensors from the checkpoint, placed on the device(s) by
`models.placement.place_block` (tensor-parallel split, quantization), then the pre-loaded LoRA adapters."""

from __future__ import annotations

import threading
from typing import Any

import torch

from corolla.models.block_base import CorollaBlock
from corolla.models.hub_files import TerminalTqdm
from corolla.models.loading import fetch_pretrained_block, load_pretrained_block
from corolla.models.lora import add_adapter, load_adapter
from corolla.models.placement import place_block
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

    c = config
    tp_devices = tuple(c.tensor_parallel_devices or ())
    blocks = {}
    with TerminalTqdm(total=len(block_indices), desc="Loading blocks", unit="block", leave=False) as progress:
        for index in block_indices:
            block = load_pretrained_block(
                c.model_name_or_path, index, config=model_config, torch_dtype=dtype, **_hub_options(c)
            )
            placed = place_block(block, device=device, quant_type=quant_type, tensor_parallel_devices=tp_devices)
            if not isinstance(placed, CorollaBlock):  # place_block splits and quantizes the block in place
                raise TypeError(f"place_block returned a {type(placed).__name__}, not the block it was given")
            for adapter in c.adapters:
                add_adapter(placed, adapter, load_adapter(adapter, index, **_hub_options(c)))
            blocks[index] = placed
            progress.update(1)
    return blocks


def fetch_span_blocks(
    config: ServerConfig, model_config: Any, block_indices: range, cancelled: threading.Event | None = None
) -> None:
    """Brings the checkpoint files of `block_indices` to the local cache (no tensor read, nothing on the device): a
    server moving to this span fetches it while still serving its old one, then loads it from the disk. Stops before
    the next block once `cancelled` is set (the move given up)."""
    for index in block_indices:
        if cancelled is not None and cancelled.is_set():
            return
        fetch_pretrained_block(config.model_name_or_path, index, config=model_config, **_hub_options(config))


def _hub_options(c: ServerConfig) -> dict[str, Any]:
    """Where the checkpoint's and the adapters' files come from and may be kept (the same for every file)."""
    return {
        "cache_dir": c.cache_dir,
        "revision": c.revision,
        "token": c.token,
        "max_disk_space_bytes": c.max_disk_space_bytes,
    }
