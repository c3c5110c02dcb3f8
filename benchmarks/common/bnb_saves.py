"""A weight as bitsandbytes' savers store it (the hub's pre-quantized "-bnb-4bit" / "-8bit" repos), made with
bitsandbytes' own quantizers, and the `quantization_config` such a save's config.json holds: the start-up bench's
pre-quantized checkpoint and the tests' are written with these."""

from __future__ import annotations

import bitsandbytes.functional as bnb_functional
import torch

NF4_CONFIG = {"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4",
              "bnb_4bit_use_double_quant": True, "bnb_4bit_compute_dtype": "bfloat16"}  # fmt: skip
INT8_CONFIG = {"quant_method": "bitsandbytes", "load_in_8bit": True}


def nf4_parts(weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """What `Linear4bit` stores for `weight` (double-quantized NF4, blocks of 64), quantized on its device: "" the
    packed codes, then "." + each key of its quant state's packed dict."""
    packed, state = bnb_functional.quantize_4bit(weight, blocksize=64, compress_statistics=True, quant_type="nf4")
    return {"": packed, **{"." + k: v for k, v in state.as_dict(packed=True).items()}}


def int8_parts(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """LLM.int8's (codes [N, K] int8, row absmaxes [N] fp32: its SCB) of `weight` (quantized in fp16, as it does)."""
    codes, row_absmax, _ = bnb_functional.int8_vectorwise_quant(weight.half())
    return codes, row_absmax.float()
