"""Weight quantization of a block's linear layers through bitsandbytes (LLM.int8 or NF4), imported only when
a quantized type is asked for: `import corolla` never imports bitsandbytes."""

from __future__ import annotations

import enum

import torch
from torch import nn

from corolla.models.tensor_parallel import SPLIT_ATTR
from corolla.utils.logging import get_logger

logger = get_logger(__name__)


class QuantType(enum.IntEnum):
    """Announced in `ServerInfo.quant_type` as the lower-case name ("none", "int8", "nf4")."""

    NONE = 0
    INT8 = 1  # LLM.int8(): int8 weights, outliers above the threshold in fp16
    NF4 = 2  # QLoRA 4-bit NormalFloat, blocks of 64 with compressed statistics

    @classmethod
    def parse(cls, value: QuantType | str | int | None) -> QuantType:
        if value is None or value == "":
            return cls.NONE
        if isinstance(value, QuantType):
            return value
        if isinstance(value, int):
            return cls(value)
        try:
            return cls[str(value).upper()]
        except KeyError:
            raise ValueError(f"Unknown quant_type {value!r}; use none, int8 or nf4") from None

    @property
    def label(self) -> str:
        return self.name.lower()


# Bytes per parameter in device memory (reference 6.1; NF4's includes its quantization statistics).
BYTES_PER_VALUE = {QuantType.INT8: 1.0, QuantType.NF4: 4.25 / 8}


def _import_bnb():
    try:
        import bitsandbytes as bnb
    except ImportError as e:
        raise ImportError("quant_type int8/nf4 needs bitsandbytes: pip install 'corolla[gpu]'") from e
    return bnb


def quantized_linear(linear: nn.Linear, quant_type: QuantType) -> nn.Module:
    """`linear` as bitsandbytes' layer of `quant_type` (INT8 or NF4), on the CPU (bitsandbytes quantizes there too;
    `quantize_block` moves it to its device)."""
    bnb = _import_bnb()
    weight = linear.weight.detach().cpu()
    has_bias = linear.bias is not None
    # The layers are built on the meta device: their own (random, fp32, CPU) initial weight is replaced below, and
    # initializing it cost ~6.7 s per Llama-3-8B block on a 2-core VM (most of an NF4 server's start over bf16's).
    if quant_type == QuantType.INT8:
        new = bnb.nn.Linear8bitLt(
            linear.in_features, linear.out_features, bias=has_bias, has_fp16_weights=False, threshold=6.0,
            device="meta",
        )  # fmt: skip
        new.weight = bnb.nn.Int8Params(weight, requires_grad=False, has_fp16_weights=False)
    else:
        new = bnb.nn.LinearNF4(
            linear.in_features, linear.out_features, bias=has_bias, compress_statistics=True,
            compute_dtype=weight.dtype, device="meta",
        )  # fmt: skip
        new.weight = bnb.nn.Params4bit(
            weight, requires_grad=False, quant_type="nf4", blocksize=64, compress_statistics=True
        )
    if has_bias:
        new.bias = nn.Parameter(linear.bias.detach().cpu(), requires_grad=False)
    if hasattr(linear, SPLIT_ATTR):
        setattr(new, SPLIT_ATTR, getattr(linear, SPLIT_ATTR))
    return new


# MoE routers stay in the block dtype: they are tiny (hidden x experts), their logits pick the experts, and the
# MoE layer reads their weight directly (a packed 4/8-bit weight cannot be used there).
KEEP_FULL_PRECISION = frozenset({"router"})


def quantize_block(block: nn.Module, quant_type: QuantType | str, device: torch.device | str) -> nn.Module:
    """Moves `block` to `device` with its linear layers quantized (call after `make_tensor_parallel`: each
    shard's linears stay on their own CUDA device). NONE just moves the block. Returns the block."""
    quant_type = QuantType.parse(quant_type)
    device = torch.device(device)
    if quant_type == QuantType.NONE:
        return block if getattr(block, "tensor_parallel_devices", None) else block.to(device)
    if device.type != "cuda":
        raise ValueError(f"quant_type {quant_type.label} needs a CUDA device, got {device}")
    _import_bnb()  # (refused before any layer is replaced)
    block.requires_grad_(False)
    replaced = 0
    for parent in list(block.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear and name not in KEEP_FULL_PRECISION:
                target = child.weight.device if child.weight.device.type == "cuda" else device
                setattr(parent, name, quantized_linear(child, quant_type).to(target))
                replaced += 1
    if not getattr(block, "tensor_parallel_devices", None):
        block.to(device)
    logger.info("quantize_block.done(type=%s, linears=%d, device=%s)", quant_type.label, replaced, device)
    return block
