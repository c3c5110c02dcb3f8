"""A random-weight llama model of a given shape on the GPU (transformers' `LlamaModel`, no LM head), and the fast
engine built from the same tensors, so both paths compute the same function."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from corolla.models.block_base import CorollaBlock
from corolla.models.registry import get_family


@contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """torch's default dtype set to `dtype` inside (modules built there get parameters of it), restored on exit."""
    saved = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(saved)


@dataclass(frozen=True)
class ModelShape:
    hidden_size: int = 4096
    num_layers: int = 32
    num_heads: int = 32
    num_kv_heads: int = 8
    intermediate_size: int = 14336
    rope_theta: float = 500000.0
    max_position_embeddings: int = 8192
    vocab_size: int = 1024  # embeddings are not part of a span; kept small

    def hf_config(self):
        from transformers import LlamaConfig

        config = LlamaConfig(
            hidden_size=self.hidden_size,
            num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads,
            intermediate_size=self.intermediate_size,
            rope_theta=self.rope_theta,
            max_position_embeddings=self.max_position_embeddings,
            vocab_size=self.vocab_size,
            rms_norm_eps=1e-5,
            tie_word_embeddings=False,
        )
        config._attn_implementation = "sdpa"
        return config


# The Llama shapes the engine benches take by name (`--shape`): Llama-3-8B's, and a tiny one for CPU dry runs.
NAMED_SHAPES = {
    "llama-3-8b": ModelShape(),
    "tiny": ModelShape(hidden_size=128, num_heads=4, num_kv_heads=2, intermediate_size=256),
}


def random_blocks(config, num_layers: int, device: torch.device, dtype: torch.dtype) -> list[CorollaBlock]:
    """corolla blocks 0..num_layers-1 of `config`, built on `device` in `dtype` with random weights (norms
    ~ N(1, 0.05), matrices ~ N(0, 0.02), from torch's global generator), in eval mode."""
    blocks = []
    for i in range(num_layers):
        with torch.device(device):
            block = get_family(config).build_block(config, i).to(dtype).eval()
        with torch.no_grad():
            for p in block.parameters():
                p.normal_(1.0, 0.05) if p.ndim == 1 else p.normal_(0.0, 0.02)
        blocks.append(block)
    return blocks


def build_hf_model(shape: ModelShape, dtype: torch.dtype, device: torch.device, seed: int = 0):
    """`LlamaModel` with random weights (normal, std 0.02) built directly on `device` in `dtype`."""
    from transformers import LlamaModel

    torch.manual_seed(seed)
    with default_dtype(dtype), torch.device(device):
        model = LlamaModel(shape.hf_config())
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("layernorm.weight") or name == "norm.weight":
                p.normal_(1.0, 0.05)  # away from 1 so norms matter
    return model.eval().requires_grad_(False)


def build_blocks(model, shape, dtype: torch.dtype, device: torch.device, num_layers: int) -> dict[int, CorollaBlock]:
    """corolla llama blocks holding the same weights as the transformers model's first `num_layers` layers."""
    config = shape.hf_config()
    family = get_family(config)
    blocks = {}
    with default_dtype(dtype):
        for i in range(num_layers):
            with torch.device(device):
                block = family.build_block(config, i)
            block.load_hf_state_dict(model.layers[i].state_dict())
            blocks[i] = block.eval().requires_grad_(False)
    return blocks
