"""Sizing: token defaults from KV heads (Mixtral counted right), cache and block bytes, num_blocks from memory."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import BloomConfig, FalconConfig, LlamaConfig, MixtralConfig

from corolla.models.sizing import count_block_parameters
from corolla.server import sizing
from corolla.utils.errors import AllocationFailed


def llama(kv_heads: int = 2, layers: int = 8) -> LlamaConfig:
    return LlamaConfig(
        hidden_size=64,
        intermediate_size=160,
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
        num_hidden_layers=layers,
    )


def hf_layer_params(config) -> int:
    """Independent count: the transformers decoder layer built on the meta device."""
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    with torch.device("meta"):
        layer = LlamaDecoderLayer(config, 0)
    return sum(p.numel() for p in layer.parameters())


@pytest.mark.parametrize(
    ("config", "kv_heads", "tokens"),
    [
        (llama(kv_heads=4), 4, 4096),
        (llama(kv_heads=2), 2, 16384),
        # Mixtral 8x22B-like head counts: the reference treats it as non-GQA (its bug); we count 8 KV heads.
        (
            MixtralConfig(
                hidden_size=96, intermediate_size=64, num_attention_heads=48, num_key_value_heads=8, num_hidden_layers=2
            ),
            8,
            16384,
        ),
        (FalconConfig(hidden_size=64, num_attention_heads=8, new_decoder_architecture=True, num_kv_heads=2), 2, 16384),
        (FalconConfig(hidden_size=64, num_attention_heads=8, multi_query=True), 1, 16384),
        (FalconConfig(hidden_size=64, num_attention_heads=8, multi_query=False), 8, 4096),
        (BloomConfig(hidden_size=64, n_head=8), 8, 4096),
    ],
    ids=["llama-mha", "llama-gqa", "mixtral", "falcon-new", "falcon-mq", "falcon-mha", "bloom"],
)
def test_token_defaults_follow_the_kv_head_count(config, kv_heads, tokens) -> None:
    assert sizing.num_kv_heads(config) == kv_heads
    assert sizing.default_attn_cache_tokens(config) == tokens
    expected_limit = 8192 if tokens == 16384 else 2048
    assert sizing.default_length_limit_tokens(config) == expected_limit  # inference_max_length's and max_batch_size's


def test_cache_bytes_match_the_worked_example_of_llama2_70b() -> None:
    config = LlamaConfig(hidden_size=8192, num_attention_heads=64, num_key_value_heads=8, num_hidden_layers=80)
    assert sizing.cache_bytes_per_block(config, torch.bfloat16) == 64 * 2**20  # 16384 tokens, bf16
    assert sizing.kv_bytes_per_token_block(config, torch.bfloat16) == 8 * 128 * 2
    assert sizing.cache_bytes_per_block(config, torch.float32, attn_cache_tokens=10) == 2 * 8 * 128 * 4 * 10


def test_block_bytes_per_quant_type() -> None:
    config = llama()
    params = hf_layer_params(config)
    assert count_block_parameters(config) == params
    assert sizing.block_size_bytes(config, dtype=torch.bfloat16) == round(params * 2 * 1.01)
    assert sizing.block_size_bytes(config, dtype=torch.float32) == round(params * 4 * 1.01)
    assert sizing.block_size_bytes(config, dtype=torch.bfloat16, quant_type="int8") == round(params * 1.01)
    assert sizing.block_size_bytes(config, dtype=torch.bfloat16, quant_type="NF4") == round(params * 4.25 / 8 * 1.01)
    with pytest.raises(ValueError, match="quant_type"):
        sizing.block_size_bytes(config, dtype=torch.bfloat16, quant_type="int3")


def test_falcon_and_bloom_blocks_can_be_sized() -> None:
    hidden, heads, head_dim = 64, 8, 8
    # fused qkv (8 query + 2x2 KV heads), dense, 4x MLP, two LayerNorms; no biases
    falcon_params = hidden * (heads + 2 * 2) * head_dim + hidden * hidden + 2 * 4 * hidden * hidden + 2 * 2 * hidden
    # fused qkv, dense, 4x MLP, all with biases; two LayerNorms
    bloom_params = (hidden * 3 * hidden + 3 * hidden) + (hidden * hidden + hidden)
    bloom_params += (hidden * 4 * hidden + 4 * hidden) + (4 * hidden * hidden + hidden) + 2 * 2 * hidden
    for config, params in (
        (FalconConfig(hidden_size=hidden, num_attention_heads=heads, new_decoder_architecture=True, num_kv_heads=2),
         falcon_params),
        (BloomConfig(hidden_size=hidden, n_head=heads), bloom_params),
    ):  # fmt: skip
        assert count_block_parameters(config) == params
        assert sizing.block_size_bytes(config, dtype=torch.float16) == round(params * 2 * 1.01)


def test_num_blocks_from_memory_is_capped_by_depth() -> None:
    config = llama(layers=8)
    dtype = torch.bfloat16
    block = sizing.block_size_bytes(config, dtype=dtype)
    cache = sizing.cache_bytes_per_block(config, dtype)
    adapters = 1000
    reserve = sizing.autograd_reserve_bytes(config)
    assert reserve == round(2 * 2**30 / 14336 * 64)
    per_block = block + cache + adapters
    memory = reserve + 5 * per_block + per_block // 2
    chosen = sizing.choose_num_blocks(
        config, device="cuda:0", dtype=dtype, adapter_bytes_per_block=adapters, total_memory_bytes=memory
    )
    assert chosen == 5
    # explicit cache size instead of the default token budget
    assert (
        sizing.choose_num_blocks(
            config, device="cuda:0", dtype=dtype, cache_bytes_per_block=0, total_memory_bytes=reserve + 3 * block
        )
        == 3
    )
    huge = reserve + 100 * per_block
    assert sizing.choose_num_blocks(config, device="cuda:0", dtype=dtype, total_memory_bytes=huge) == 8
    # two TP devices double the autograd reserve
    assert abs(sizing.autograd_reserve_bytes(config, 2) - 2 * reserve) <= 1


def test_not_even_one_block_is_allocation_failed() -> None:
    config = llama()
    with pytest.raises(AllocationFailed, match="one block needs"):
        sizing.choose_num_blocks(
            config, device="cuda:0", dtype=torch.bfloat16, total_memory_bytes=sizing.autograd_reserve_bytes(config)
        )


def test_cpu_server_must_be_told_how_many_blocks() -> None:
    with pytest.raises(ValueError, match="--num_blocks or --block_indices"):
        sizing.choose_num_blocks(llama(), device="cpu", dtype=torch.float32)


def test_tensor_parallel_memory_uses_the_smallest_device() -> None:
    assert sizing.combined_memory_bytes([80, 100]) == 160
    with pytest.raises(ValueError, match="1.5x"):
        sizing.combined_memory_bytes([40, 100])
    assert math.isclose(sizing.combined_memory_bytes([100]), 100)


def test_adapter_bytes_count_the_lora_tensors_a_block_stores(tmp_path) -> None:
    import json

    from safetensors.torch import save_file

    from helpers.tiny_models import tiny_config

    config = tiny_config("llama", 2)  # hidden 64, q 64 + k 32 + v 32 rows fused in qkv, intermediate 128
    rank, hidden, inter, qkv_rows = 4, 64, 128, 128
    tensors = {}
    for layer in (0, 1):
        prefix = f"base_model.model.model.layers.{layer}"
        tensors[f"{prefix}.self_attn.q_proj.lora_A.weight"] = torch.zeros(rank, hidden)
        tensors[f"{prefix}.self_attn.q_proj.lora_B.weight"] = torch.zeros(hidden, rank)
        tensors[f"{prefix}.mlp.down_proj.lora_A.weight"] = torch.zeros(rank, inter)
        tensors[f"{prefix}.mlp.down_proj.lora_B.weight"] = torch.zeros(hidden, rank)
    save_file(tensors, str(tmp_path / "adapter_model.safetensors"))
    (tmp_path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": 8}))

    # q's B is stored over the whole fused qkv output (zeros on k and v's rows): 128 rows, not the checkpoint's 64
    per_block = rank * (hidden + qkv_rows) + rank * (inter + hidden)
    got = sizing.adapter_bytes_per_block([str(tmp_path)], dtype=torch.bfloat16, model_config=config)
    assert got == 2 * per_block
    got = sizing.adapter_bytes_per_block([str(tmp_path)] * 2, dtype=torch.float32, model_config=config)
    assert got == 2 * 4 * per_block
    assert sizing.adapter_bytes_per_block([], dtype=torch.float32, model_config=config) == 0
