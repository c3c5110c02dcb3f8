"""place_block: the one order of tensor-parallel split, quantization and device move used by servers and throughput."""

from __future__ import annotations

import copy

import pytest
import torch

from corolla.models.config import load_config
from corolla.models.loading import load_pretrained_block
from corolla.models.placement import place_block
from helpers.tiny_models import make_tiny_model


@pytest.fixture(scope="module")
def block(tmp_path_factory):
    model_dir = make_tiny_model("llama", tmp_path_factory.mktemp("models"))
    return load_pretrained_block(model_dir, 0, config=load_config(model_dir), torch_dtype=torch.float32)


def test_split_over_devices_then_same_outputs(block):
    placed = place_block(copy.deepcopy(block), device="cpu", tensor_parallel_devices=["cpu", "cpu"])
    assert len(placed.attn.shards) == 2
    x = torch.randn(1, 5, 64)
    with torch.no_grad():
        torch.testing.assert_close(placed(x), block(x), atol=1e-5, rtol=0)


def test_single_device_is_a_plain_move(block):
    placed = place_block(copy.deepcopy(block), device="cpu", quant_type="none", tensor_parallel_devices=["cpu"])
    assert not hasattr(placed.attn, "shards")
    assert {p.device.type for p in placed.parameters()} == {"cpu"}


def test_quantization_needs_cuda(block):
    with pytest.raises(ValueError, match="needs a CUDA device"):
        place_block(copy.deepcopy(block), device="cpu", quant_type="nf4")
