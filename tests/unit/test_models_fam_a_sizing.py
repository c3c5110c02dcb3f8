"""FAM-A families beyond the block math: default DHT prefixes, KV bytes per token per block (the architecture's
formula: MLA caches latent + rotary key, not per-head K/V) equal to the cache descriptors and to what the server
logs, partial loading of sharded checkpoints, MoE blocks' memory at real layer shapes, and bf16 blocks."""

from __future__ import annotations

import json
import os

import pytest
import torch
import transformers as tf
from transformers import AutoModelForCausalLM

import helpers.tiny_models_fam_a as fam_a
from corolla.models import loading
from corolla.models.config import load_config
from corolla.models.loading import load_pretrained_block
from corolla.models.registry import get_family
from corolla.models.sizing import count_block_parameters, kv_cache_bytes_per_token, kv_cache_values_per_token
from corolla.server import sizing as server_sizing
from helpers.tiny_models import capture_hf_layer, make_tiny_model

pytestmark = pytest.mark.usefixtures("single_torch_thread")


def deepseek_v3_real_shape(num_layers: int = 61):
    """DeepSeek-V3's published layer shapes (671B total); weights never built."""
    return tf.DeepseekV3Config(num_hidden_layers=num_layers)


def qwen3_30b_a3b_shape():
    return tf.Qwen3MoeConfig(
        hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=48,
        num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
        vocab_size=151936,
    )  # fmt: skip


@pytest.mark.parametrize(
    "model_type, repo, prefix",
    [
        ("qwen3", "Qwen/Qwen3-32B", "Qwen3-32B-hf"),
        ("qwen3_moe", "Qwen/Qwen3-235B-A22B-Instruct-2507", "Qwen3-235B-A22B-Instruct-2507-hf"),
        ("phi3", "microsoft/Phi-3.5-mini-instruct", "Phi-3-5-mini-instruct-hf"),
        ("phi3", "microsoft/phi-4", "phi-4-hf"),
        ("deepseek_v3", "deepseek-ai/DeepSeek-V3", "DeepSeek-V3-hf"),
    ],
)
def test_default_dht_prefix(model_type, repo, prefix):
    assert get_family(model_type).default_dht_prefix(repo) == prefix


@pytest.mark.parametrize("family", fam_a.FAM_A_FAMILIES)
def test_kv_bytes_per_token_match_the_architecture_and_the_cache(family):
    config = fam_a.tiny_config_of(family)
    if family == "deepseek_v3":
        expected_values = config.kv_lora_rank + config.qk_rope_head_dim  # 16 + 8: the latent and the rotary key
    else:
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        expected_values = 2 * config.num_key_value_heads * head_dim
    assert kv_cache_values_per_token(config) == expected_values
    assert kv_cache_bytes_per_token(config, torch.bfloat16) == 2 * expected_values
    # what the server logs (2 x its K-or-V unit) and reserves
    assert 2 * server_sizing.kv_bytes_per_token_block(config, torch.bfloat16) == 2 * expected_values
    with torch.device("meta"):
        block = get_family(config).build_block(config, 1).to(torch.bfloat16)
    descriptors = block.cache_descriptors(3, 10)
    assert sum(d.nbytes for d in descriptors) == 3 * 10 * 2 * expected_values


def test_mla_cache_holds_the_latent_not_full_kv():
    config = deepseek_v3_real_shape()
    with torch.device("meta"):
        block = get_family(config).build_block(config, 3)
    shapes = [d.shape for d in block.cache_descriptors(1, 4096)]
    assert shapes == [(1, 1, 4096, 512), (1, 1, 4096, 64)]
    assert kv_cache_bytes_per_token(config, torch.bfloat16) == (512 + 64) * 2  # 1152 bytes per token per block
    full_kv = 2 * 128 * (128 + 64) * 2  # what per-head K/V of 128 heads would take: 85x more
    assert full_kv // kv_cache_bytes_per_token(config, torch.bfloat16) == 85


def test_deepseek_v3_sizing_counts_every_expert_as_memory():
    config = deepseek_v3_real_shape()
    moe_layer_params = count_block_parameters(config)  # the largest block: a MoE one, not dense block 0
    assert 11.4e9 < moe_layer_params < 11.6e9


def test_qwen3_moe_block_parameters_are_mostly_experts():
    config = qwen3_30b_a3b_shape()
    experts = 128 * 3 * 2048 * 768
    assert 0.95 < experts / count_block_parameters(config) < 1.0


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_sharded_checkpoint_opens_only_the_blocks_shards(family, tmp_path):
    opened: list[str] = []
    loading.FILE_OPEN_HOOKS.append(opened.append)
    try:
        model_dir = make_tiny_model(family, tmp_path, sharded=True)
        weight_map = json.loads((model_dir / "model.safetensors.index.json").read_text())["weight_map"]
        needed = {file for name, file in weight_map.items() if name.startswith("model.layers.2.")}
        assert len(set(weight_map.values())) > len(needed) + 2
        load_pretrained_block(model_dir, 2, config=load_config(model_dir), torch_dtype=torch.float32)
    finally:
        loading.FILE_OPEN_HOOKS.remove(opened.append)
    assert {os.path.basename(p) for p in opened} == needed


@pytest.mark.parametrize("family", fam_a.FAM_A_FAMILIES)
def test_bfloat16_block_matches_transformers_in_bfloat16(family, tmp_path):
    model_dir = make_tiny_model(family, tmp_path, num_layers=2, dtype=torch.bfloat16)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
    block = load_pretrained_block(model_dir, 1, config=load_config(model_dir), torch_dtype="auto")
    assert block.dtype == torch.bfloat16
    if family == "deepseek_v3":  # the router stays fp32, as transformers keeps it
        assert block.mlp.router.weight.dtype == block.mlp.e_score_correction_bias.dtype == torch.float32
    x, ref, _ = capture_hf_layer(hf, 1, torch.randint(3, 300, (2, 13)))
    with torch.no_grad():
        torch.testing.assert_close(block(x), ref, atol=0.07, rtol=0.01)
        cache = [d.make_zeros() for d in block.cache_descriptors(2, 13)]
        steps = [block(x[:, :10], cache=cache, position=0), block(x[:, 10:], cache=cache, position=10)]
        torch.testing.assert_close(torch.cat(steps, dim=1), ref, atol=0.07, rtol=0.01)
