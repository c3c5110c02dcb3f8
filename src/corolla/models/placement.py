"""Putting a loaded block on its device(s): tensor-parallel split first, then quantization of each shard on its own
device (quantized weights cannot be sliced), or a plain move. The one place that knows this order."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from corolla.models.block_base import CorollaBlock
from corolla.models.quantization import QuantType, quantize_block
from corolla.models.tensor_parallel import make_tensor_parallel


def place_block(
    block: CorollaBlock,
    *,
    device: torch.device | str,
    quant_type: QuantType | str = QuantType.NONE,
    tensor_parallel_devices: Sequence[torch.device | str] = (),
) -> nn.Module:
    """Returns `block` split over `tensor_parallel_devices` (when more than one) and quantized, on `device`."""
    if len(tensor_parallel_devices) > 1:
        block = make_tensor_parallel(block, [torch.device(d) for d in tensor_parallel_devices])
    return quantize_block(block, quant_type, device)  # QuantType.NONE only moves it (TP shards stay put)
