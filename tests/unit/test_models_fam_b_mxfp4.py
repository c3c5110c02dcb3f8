"""gpt-oss MXFP4 expert weights (OpenAI's published packing) dequantize to what transformers' own converter gives,
load into a block through `normalize_checkpoint_names`, and malformed packings are refused before any work."""

from __future__ import annotations

import pytest
import torch
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

import helpers.tiny_models_fam_b  # noqa: F401  (registers the tiny gpt-oss config)
from corolla.models.gpt_oss.mxfp4 import dequantize_mxfp4
from corolla.models.registry import get_family
from helpers.tiny_models import tiny_config


def _packed(E: int, rows: int, cols: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (E, rows, cols // 32, 16), generator=g, dtype=torch.int64).to(torch.uint8)
    scales = torch.randint(120, 131, (E, rows, cols // 32), generator=g, dtype=torch.int64).to(torch.uint8)
    return blocks, scales


def test_dequantize_matches_transformers_converter():
    blocks, scales = _packed(3, 10, 64, seed=1)
    ours = dequantize_mxfp4(blocks, scales)  # [3, 64, 10]
    assert ours.shape == (3, 64, 10)
    torch.testing.assert_close(ours, convert_moe_packed_tensors(blocks, scales, dtype=torch.float32), atol=0, rtol=0)


def test_block_loads_mxfp4_experts():
    config = tiny_config("gpt_oss", num_layers=2)
    config.intermediate_size = 64  # MXFP4 packs 32 values per block: real models' sizes are multiples of 32
    block = get_family(config).build_block(config, 1).float()
    E, H, inter = config.num_local_experts, config.hidden_size, config.intermediate_size
    state = {name: torch.randn(*shape) for name, shape in block.expected_checkpoint_shapes().items()}
    del state["mlp.experts.gate_up_proj"], state["mlp.experts.down_proj"]
    state["mlp.experts.gate_up_proj_blocks"], state["mlp.experts.gate_up_proj_scales"] = _packed(E, 2 * inter, H, 2)
    state["mlp.experts.down_proj_blocks"], state["mlp.experts.down_proj_scales"] = _packed(E, H, inter, 3)
    block.load_hf_state_dict(state)
    torch.testing.assert_close(
        block.mlp.experts.gate_up_proj,
        dequantize_mxfp4(state["mlp.experts.gate_up_proj_blocks"], state["mlp.experts.gate_up_proj_scales"]),
    )
    assert block.mlp.experts.down_proj.shape == (E, inter, H)


def test_malformed_packings_are_refused():
    blocks, scales = _packed(2, 4, 32, seed=4)
    with pytest.raises(ValueError, match="must be uint8"):
        dequantize_mxfp4(blocks.to(torch.int16), scales)
    with pytest.raises(ValueError, match=r"\[E, rows, G, 16\]"):
        dequantize_mxfp4(blocks, scales[:, :3])
    config = tiny_config("gpt_oss", num_layers=2)
    block = get_family(config).build_block(config, 0)
    with pytest.raises(ValueError, match="needs both"):
        block.normalize_checkpoint_names({"mlp.experts.down_proj_blocks": blocks})
