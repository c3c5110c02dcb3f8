"""bf16 numerics of corolla's blocks on a real GPU: for every family, a block's update (output - input) in bf16 is
as close to the float32 reference as transformers' own layer in bf16 is (same inputs, same weights), without and
with the KV cache. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from corolla.models.config import load_config
from corolla.models.loading import load_pretrained_block
from helpers.tiny_models import FAMILIES, capture_hf_layer, hf_layers, make_tiny_model

LAYER = 1


def _update_err(out: torch.Tensor, ref: torch.Tensor, x: torch.Tensor) -> float:
    return float(((out.float() - x.float()) - (ref - x)).norm() / (ref - x).norm())


@torch.no_grad()
@pytest.mark.parametrize("family", FAMILIES)
def test_block_bf16_as_close_to_fp32_as_transformers(family: str, tmp_path) -> None:
    path = make_tiny_model(family, tmp_path)
    config = load_config(path)
    ids = torch.randint(3, config.vocab_size, (2, 24), device="cuda")
    hf32 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda().eval()
    x, ref, _ = capture_hf_layer(hf32, LAYER, ids)  # float32 input and reference output [2, 24, H]
    hf16 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda().eval()
    _, _, kwargs16 = capture_hf_layer(hf16, LAYER, ids)  # bf16 masks / rotary tables for the same positions
    hf_out = hf_layers(hf16)[LAYER](x.bfloat16(), **kwargs16)
    hf_out = hf_out[0] if isinstance(hf_out, tuple) else hf_out
    block = load_pretrained_block(path, LAYER, config=config, torch_dtype=torch.bfloat16).cuda().eval()
    ours = block(x.bfloat16())
    cache = [d.make_zeros() for d in block.cache_descriptors(2, 32)]
    steps = [block(x[:, :20].bfloat16(), cache=cache, position=0)]
    steps += [block(x[:, i : i + 1].bfloat16(), cache=cache, position=i) for i in range(20, 24)]
    cached = torch.cat(steps, dim=1)
    err_hf, err_ours, err_cached = (_update_err(t, ref, x) for t in (hf_out, ours, cached))
    print(f"bf16-vs-fp32 {family}: transformers {err_hf:.2e}, corolla {err_ours:.2e}, corolla cached {err_cached:.2e}")
    assert err_ours <= 2 * err_hf + 5e-3
    assert err_cached <= 2 * err_hf + 5e-3
