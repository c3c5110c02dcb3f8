"""How much a server can hold: default token limits from the model's KV head count, KV cache bytes per block,
block bytes per quantization type, and `choose_num_blocks` from device memory (capped by the model's depth)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from corolla.models.block_base import CorollaBlock
from corolla.models.lora import adapter_stored_bytes, load_adapter
from corolla.models.registry import get_family
from corolla.models.sizing import block_size_bytes, kv_cache_bytes_per_token
from corolla.utils.errors import AllocationFailed
from corolla.utils.logging import get_logger

logger = get_logger(__name__)

GQA_ATTN_CACHE_TOKENS = 16384
MHA_ATTN_CACHE_TOKENS = 4096
GQA_MAX_LENGTH_TOKENS = 8192  # inference_max_length and max_batch_size defaults with GQA/MQA
MHA_MAX_LENGTH_TOKENS = 2048
# Reserve for activations of forward/backward: 2 GiB per device at BLOOM-176B's hidden size, scaled linearly.
AUTOGRAD_RESERVE_BYTES_AT_REFERENCE = 2 * 2**30
AUTOGRAD_REFERENCE_HIDDEN_SIZE = 14336
MAX_TENSOR_PARALLEL_MEMORY_RATIO = 1.5


# ---- KV heads and token limits


def num_kv_heads(config: Any) -> int:
    """KV heads cached per block, from the model family (Mixtral's `num_key_value_heads` counted correctly)."""
    try:
        return int(get_family(config).num_kv_heads(config))
    except ValueError:  # unknown family: the common config attribute
        return int(getattr(config, "num_key_value_heads", None) or config.num_attention_heads)


def is_grouped_query(config: Any) -> bool:
    """True for GQA/MQA models (fewer KV heads than query heads): they get the larger token defaults."""
    return num_kv_heads(config) < int(config.num_attention_heads)


def default_attn_cache_tokens(config: Any) -> int:
    """KV cache budget per block in tokens: 16384 for GQA/MQA models, else 4096."""
    return GQA_ATTN_CACHE_TOKENS if is_grouped_query(config) else MHA_ATTN_CACHE_TOKENS


def default_length_limit_tokens(config: Any) -> int:
    """The default of both `inference_max_length` and `max_batch_size`: 8192 for GQA/MQA models, else 2048."""
    return GQA_MAX_LENGTH_TOKENS if is_grouped_query(config) else MHA_MAX_LENGTH_TOKENS


# ---- bytes


def kv_bytes_per_token_block(config: Any, dtype: torch.dtype) -> int:
    """Bytes of K (or V) of one token in one block: the unit of the announced `cache_tokens_left` (half the
    architecture's per-token cache bytes, e.g. MLA's latent + rotary key)."""

    return kv_cache_bytes_per_token(config, dtype) // 2


def cache_bytes_per_block(config: Any, dtype: torch.dtype, attn_cache_tokens: int | None = None) -> int:
    """K + V bytes of `attn_cache_tokens` tokens (default per `default_attn_cache_tokens`) in one block."""
    tokens = default_attn_cache_tokens(config) if attn_cache_tokens is None else attn_cache_tokens
    if tokens < 0:
        raise ValueError(f"attn_cache_tokens must be >= 0, got {tokens}")
    return 2 * kv_bytes_per_token_block(config, dtype) * tokens


_cache_bytes_per_block = cache_bytes_per_block  # reachable inside functions whose argument shares the name


def adapter_bytes_per_block(
    adapters: Sequence[str], *, dtype: torch.dtype, model_config: Any, block_index: int = 0, **load_kwargs: Any
) -> int:
    """Device memory the LoRA `adapters` add to block `block_index` of `model_config`'s model, in `dtype`: what
    `models.lora.add_adapter` stores (B over a fused projection's whole output, e.g. q/k/v's A and B both sized by
    the summed rank; `models.lora.adapter_stored_bytes` on a meta-device block), which the fast path's stacks
    reuse. `load_kwargs` go to `models.lora.load_adapter` (cache_dir, revision, token, max_disk_space_bytes)."""
    if not adapters:
        return 0

    with torch.device("meta"):  # the block's geometry only: nothing allocated
        block = get_family(model_config).build_block(model_config, block_index)
    if not isinstance(block, CorollaBlock):
        raise TypeError(f"{type(block).__name__} is not a CorollaBlock: can't size its adapters")
    return sum(adapter_stored_bytes(block, load_adapter(name, block_index, **load_kwargs), dtype) for name in adapters)


def autograd_reserve_bytes(config: Any, num_devices: int = 1) -> int:
    """Memory kept free for forward/backward activations (the reference's rule)."""
    return round(
        AUTOGRAD_RESERVE_BYTES_AT_REFERENCE * num_devices / AUTOGRAD_REFERENCE_HIDDEN_SIZE * config.hidden_size
    )


# ---- devices and block count


def combined_memory_bytes(per_device_bytes: Sequence[int]) -> int:
    """Usable memory of a tensor-parallel group: the smallest device times the number of devices.
    ValueError when the devices differ by more than 1.5x (most of the larger one would be wasted)."""
    if not per_device_bytes:
        raise ValueError("Need at least one device")
    low, high = min(per_device_bytes), max(per_device_bytes)
    if low <= 0 or high / low > MAX_TENSOR_PARALLEL_MEMORY_RATIO:
        raise ValueError(
            f"Tensor-parallel devices differ too much in memory ({low} vs {high} bytes, more than "
            f"{MAX_TENSOR_PARALLEL_MEMORY_RATIO}x): use devices of similar size or pass --num_blocks"
        )
    return low * len(per_device_bytes)


def device_memory_bytes(device: torch.device | str, tensor_parallel_devices: Sequence[torch.device | str] = ()) -> int:
    """Total memory available for blocks: a CUDA device (or a TP group of them), or system RAM for MPS.
    ValueError for CPU servers, which must be told how many blocks to serve."""
    devices = [torch.device(d) for d in tensor_parallel_devices] or [torch.device(device)]
    kinds = {d.type for d in devices}
    if kinds == {"cuda"}:
        return combined_memory_bytes([torch.cuda.get_device_properties(d).total_memory for d in devices])
    if kinds == {"mps"}:
        import psutil

        return int(psutil.virtual_memory().total)
    raise ValueError(
        f"Can't choose the number of blocks automatically on {sorted(kinds)} (no GPU): "
        f"a CPU server must be given --num_blocks or --block_indices"
    )


def choose_num_blocks(
    config: Any,
    *,
    device: torch.device | str,
    dtype: torch.dtype,
    quant_type: Any = "none",
    cache_bytes_per_block: int | None = None,
    adapter_bytes_per_block: int = 0,
    tensor_parallel_devices: Sequence[torch.device | str] = (),
    total_memory_bytes: int | None = None,
) -> int:
    """How many blocks fit: floor((memory - autograd reserve) / (block + KV cache + adapters)), capped by the
    model's depth. `total_memory_bytes` overrides the device query. ValueError on CPU; AllocationFailed when not
    even one block fits."""
    num_devices = max(1, len(tensor_parallel_devices))
    if total_memory_bytes is None:
        total_memory_bytes = device_memory_bytes(device, tensor_parallel_devices)
    if cache_bytes_per_block is None:
        cache_bytes_per_block = _cache_bytes_per_block(config, dtype)
    block_bytes = block_size_bytes(config, dtype=dtype, quant_type=quant_type)
    per_block = block_bytes + cache_bytes_per_block + adapter_bytes_per_block
    reserve = autograd_reserve_bytes(config, num_devices)
    num_blocks = math.floor((total_memory_bytes - reserve) / per_block)
    if num_blocks < 1:
        raise AllocationFailed(
            f"Not enough device memory to serve one block: {total_memory_bytes} bytes in total, {reserve} reserved "
            f"for autograd, one block needs {per_block} bytes (weights {block_bytes}, KV cache "
            f"{cache_bytes_per_block}, adapters {adapter_bytes_per_block}); use quantization, a smaller "
            f"--attn_cache_tokens or a bigger GPU"
        )
    depth = int(config.num_hidden_layers)
    chosen = min(num_blocks, depth)
    logger.info(
        f"sizing.choose_num_blocks(memory={total_memory_bytes}, per_block={per_block}, reserve={reserve}, "
        f"fits={num_blocks}, depth={depth}, chosen={chosen})"
    )
    return chosen
