"""On a real GPU: int8 and nf4 blocks (bitsandbytes) run, stay close to bf16, keep the cache contract, and combine
with tensor parallelism over two cards. Skipped without CUDA or bitsandbytes."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers as tf

from corolla.models.quantization import QuantType, quantize_block
from corolla.models.registry import get_family
from corolla.models.tensor_parallel import make_tensor_parallel

# Relative error of the block's update (output - input) against bf16; nf4 is coarser than int8.
TOLERANCE = {QuantType.INT8: 0.08, QuantType.NF4: 0.25}


def _config(model_type: str):
    common = dict(hidden_size=1024, num_attention_heads=8, num_hidden_layers=2, max_position_embeddings=4096)
    if model_type == "llama":
        return tf.LlamaConfig(**common, num_key_value_heads=2, intermediate_size=2816)
    if model_type == "mixtral":
        return tf.MixtralConfig(**common, num_key_value_heads=2, intermediate_size=1408, num_local_experts=4)
    return tf.FalconConfig(**common, num_kv_heads=2, new_decoder_architecture=True, parallel_attn=True, bias=False)


def _random_block(model_type: str):
    torch.manual_seed(0)
    config = _config(model_type)
    block = get_family(config).build_block(config, 0).to(torch.bfloat16)
    block.requires_grad_(False)
    return block


def _relative_error(out: torch.Tensor, ref: torch.Tensor, x: torch.Tensor) -> float:
    return ((out - x).float() - (ref - x).float()).norm().item() / (ref - x).float().norm().item()


@pytest.mark.parametrize("model_type", ["llama", "mixtral", "falcon"])
@pytest.mark.parametrize("quant_type", [QuantType.INT8, QuantType.NF4])
def test_quantized_block_close_to_bf16(model_type, quant_type):
    pytest.importorskip("bitsandbytes")
    reference = _random_block(model_type).cuda()
    quantized = quantize_block(copy.deepcopy(reference).cpu(), quant_type, "cuda")
    assert any("bitsandbytes" in type(m).__module__ for m in quantized.modules())
    # MoE routers stay full precision (they are read as plain weights and pick the experts)
    assert all(type(m.router) is torch.nn.Linear for m in quantized.modules() if hasattr(m, "router"))
    x = torch.randn(2, 16, 1024, device="cuda", dtype=torch.bfloat16)
    with torch.inference_mode():
        ref = reference(x)
        out = quantized(x)
        assert _relative_error(out, ref, x) < TOLERANCE[quant_type]
        cache = [d.make_zeros() for d in quantized.cache_descriptors(2, 32)]
        assert all(d.dtype == torch.bfloat16 for d in quantized.cache_descriptors(2, 32))
        steps = [quantized(x[:, :12], cache=cache, position=0)]
        steps += [quantized(x[:, i : i + 1], cache=cache, position=i) for i in range(12, 16)]
        torch.testing.assert_close(torch.cat(steps, dim=1), out, atol=0.05, rtol=0.05)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
@pytest.mark.parametrize("quant_type", [QuantType.NONE, QuantType.NF4])
def test_tensor_parallel_over_two_gpus(quant_type):
    if quant_type != QuantType.NONE:
        pytest.importorskip("bitsandbytes")
    reference = _random_block("llama").cuda()
    split = make_tensor_parallel(copy.deepcopy(reference).cpu(), ["cuda:0", "cuda:1"])
    split = quantize_block(split, quant_type, "cuda:0")
    assert {p.device.index for p in split.attn.shards[1].parameters()} == {1}
    x = torch.randn(1, 8, 1024, device="cuda:0", dtype=torch.bfloat16)
    with torch.inference_mode():
        err = _relative_error(split(x), reference(x), x)
        assert err < (0.02 if quant_type == QuantType.NONE else TOLERANCE[QuantType.NF4])
        descriptors = split.cache_descriptors(1, 16)
        assert [d.device.index for d in descriptors] == [0, 0, 1, 1]
