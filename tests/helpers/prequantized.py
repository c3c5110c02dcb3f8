"""Pre-quantized bitsandbytes checkpoints of the tiny models, written as bitsandbytes' own savers write them (its
quantizer and its quant state's packed dict, on the CPU), beside the 16-bit checkpoint of bitsandbytes' dequantized
weights that they stand for."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import bitsandbytes.functional as bnb_functional
import torch
from safetensors.torch import load_file, save_file
from tests.helpers.tiny_models import make_tiny_model

from benchmarks.common.bnb_saves import INT8_CONFIG, NF4_CONFIG, int8_parts, nf4_parts

PROJECTION = re.compile(r"model\.layers\.\d+\..*_proj\.weight$")


def derived_checkpoint(src: Path, out: Path, tensors: dict[str, torch.Tensor], quantization: dict | None) -> Path:
    shutil.copytree(src, out)
    save_file(tensors, str(out / "model.safetensors"))
    config = json.loads((out / "config.json").read_text())
    if quantization is not None:
        config["quantization_config"] = quantization
    (out / "config.json").write_text(json.dumps(config))
    return out


def prequantized_checkpoints(
    tmp_path: Path,
    bits: int,
    dtype: torch.dtype = torch.bfloat16,
    num_layers: int = 4,
    device: torch.device = torch.device("cpu"),
    head: bool = False,
) -> tuple[Path, Path]:
    """(the pre-quantized checkpoint of a tiny Llama saved in `dtype`, the `dtype` one of bitsandbytes' dequantized
    weights), for 4 (NF4, double-quantized) or 8 (LLM.int8) bits, quantized by bitsandbytes on `device`; with `head`,
    the LM head quantized too (bitsandbytes' savers leave it 16-bit unless told otherwise)."""
    src = make_tiny_model("llama", tmp_path, dtype=dtype, num_layers=num_layers)
    tensors = load_file(str(src / "model.safetensors"))
    quantized, dequantized = {}, {}
    for name, t in tensors.items():
        if not (PROJECTION.match(name) or (head and name == "lm_head.weight")):
            quantized[name] = dequantized[name] = t
        elif bits == 4:
            parts = nf4_parts(t.to(device))
            quantized.update({name + suffix: v.cpu() for suffix, v in parts.items()})
            state = bnb_functional.QuantState.from_dict(
                {k.lstrip("."): v for k, v in parts.items() if k}, device=device
            )
            dequantized[name] = bnb_functional.dequantize_4bit(parts[""], state).to(dtype).cpu()
        else:
            codes, row_absmax = int8_parts(t)
            prefix = name.removesuffix("weight")
            quantized.update(
                {name: codes, prefix + "SCB": row_absmax, prefix + "weight_format": torch.tensor(0, dtype=torch.uint8)}
            )
            dequantized[name] = (codes.float() * (row_absmax / 127)[:, None]).to(dtype)
    config = NF4_CONFIG if bits == 4 else INT8_CONFIG
    tag = "-head" if head else ""
    return (
        derived_checkpoint(src, tmp_path / f"prequantized-{bits}-{str(dtype)[6:]}{tag}", quantized, config),
        derived_checkpoint(src, tmp_path / f"dequantized-{bits}-{str(dtype)[6:]}{tag}", dequantized, None),
    )
