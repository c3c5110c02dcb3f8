"""Tiny llama-family blocks with random LoRA adapters of different ranks attached (the engine's adapter tests)."""

from __future__ import annotations

import torch

from corolla.models.lora import LoraWeights, add_adapter
from corolla.models.registry import get_family
from helpers.tiny_models import tiny_config

ALL_MODULES = [f"self_attn.{p}_proj" for p in "qkvo"] + [f"mlp.{p}_proj" for p in ("gate", "up", "down")]
# name -> (rank, checkpoint modules, layers it changes); on the other layers the adapter is loaded with no tensors
ADAPTERS: dict[str, tuple[int, list[str], tuple[int, ...]]] = {
    "big": (8, ALL_MODULES, (0, 1, 2)),
    "mid": (4, ALL_MODULES, (0, 1, 2)),
    "some": (2, ["self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj"], (0, 2)),
}


def module_shapes(config) -> dict[str, tuple[int, int]]:
    """Checkpoint module -> (out, in) of a llama layer."""
    h, d = int(config.hidden_size), int(config.hidden_size) // int(config.num_attention_heads)
    nq, nkv, inter = int(config.num_attention_heads), int(config.num_key_value_heads), int(config.intermediate_size)
    return {
        "self_attn.q_proj": (nq * d, h),
        "self_attn.k_proj": (nkv * d, h),
        "self_attn.v_proj": (nkv * d, h),
        "self_attn.o_proj": (h, nq * d),
        "mlp.gate_proj": (inter, h),
        "mlp.up_proj": (inter, h),
        "mlp.down_proj": (h, inter),
    }


def make_lora_blocks(
    family: str = "llama",
    num_layers: int = 3,
    adapters: dict[str, tuple[int, list[str], tuple[int, ...]]] = ADAPTERS,
    seed: int = 0,
) -> list[torch.nn.Module]:
    """`num_layers` blocks of a tiny `family` model (random weights, norms away from 1) carrying `adapters`."""
    torch.manual_seed(seed)
    config = tiny_config(family, num_layers)
    blocks = [get_family(config).build_block(config, i) for i in range(num_layers)]
    shapes = module_shapes(config)
    for index, block in enumerate(blocks):
        for p in block.parameters():
            if p.ndim > 1:
                torch.nn.init.normal_(p, std=0.15)
            else:
                torch.nn.init.normal_(p, mean=1.0, std=0.2)
        block.eval()
        for name, (rank, modules, layers) in adapters.items():
            weights = {
                m: (torch.randn(rank, shapes[m][1]) * 0.3, torch.randn(shapes[m][0], rank) * 0.3, 0.5)
                for m in (modules if index in layers else ())
            }
            add_adapter(block, name, LoraWeights("test", index, weights))
    return blocks
