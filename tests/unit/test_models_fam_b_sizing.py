"""Sizing of the FAM-B families: KV bytes per token = the architecture's formula = the server's figure; what a
session reserves per layer (full layers: every position; sliding layers: window + slack positions and the ring
state) = the cache descriptors' bytes, at tiny and at real gpt-oss-20b / Gemma 2 9B shapes (meta device); the
rollback rule at the default slack; gpt-oss experts' share of a span's memory and its active parameters."""

from __future__ import annotations

import pytest
import torch
import transformers as tf

import helpers.tiny_models_fam_b as fam_b
from corolla.models.attention import DEFAULT_SLIDING_SLACK_TOKENS
from corolla.models.registry import get_family
from corolla.models.sizing import count_block_parameters, kv_cache_bytes_per_token
from corolla.server import sizing as server_sizing
from helpers.tiny_models import tiny_config


def _real_configs():
    gpt_oss_20b = tf.GptOssConfig(  # openai/gpt-oss-20b's shapes
        hidden_size=2880, num_hidden_layers=24, num_attention_heads=64, num_key_value_heads=8, head_dim=64,
        intermediate_size=2880, num_local_experts=32, num_experts_per_tok=4, sliding_window=128,
    )  # fmt: skip
    gemma2_9b = tf.Gemma2Config(  # google/gemma-2-9b's shapes
        hidden_size=3584, num_hidden_layers=42, num_attention_heads=16, num_key_value_heads=8, head_dim=256,
        intermediate_size=14336, sliding_window=4096, query_pre_attn_scalar=256,
    )  # fmt: skip
    return {"gpt_oss_20b": gpt_oss_20b, "gemma2_9b": gemma2_9b}


def _block(config, layer: int):
    with torch.device("meta"):
        return get_family(config).build_block(config, layer).to(torch.bfloat16)


@pytest.mark.parametrize("family", fam_b.FAM_B_FAMILIES)
def test_kv_bytes_per_token_is_the_formula_and_the_servers(family):
    config = tiny_config(family, num_layers=3)
    formula = 2 * config.num_key_value_heads * config.head_dim * torch.bfloat16.itemsize
    assert kv_cache_bytes_per_token(config, torch.bfloat16) == formula == 2 * 2 * 16 * 2
    assert 2 * server_sizing.kv_bytes_per_token_block(config, torch.bfloat16) == formula


@pytest.mark.parametrize("name", ["gpt_oss_20b", "gemma2_9b"])
@pytest.mark.parametrize("max_length", [100, 8192])
def test_cache_descriptors_of_sliding_and_global_layers_at_real_shapes(name, max_length):
    config = _real_configs()[name]
    per_token = 2 * config.num_key_value_heads * config.head_dim * 2  # bf16
    window = config.sliding_window
    for layer in (0, 1):  # layer 0 slides, layer 1 is global in both families
        block = _block(config, layer)
        reserved = sum(d.nbytes for d in block.cache_descriptors(2, max_length))  # what the block's own cache takes
        if layer == 1:
            assert reserved == 2 * max_length * per_token
        else:
            held = min(max_length, window + DEFAULT_SLIDING_SLACK_TOKENS)
            assert reserved == 2 * (held * per_token + 16)


def test_default_slack_rollback_rule():
    config = tiny_config("gpt_oss", num_layers=2)
    torch.manual_seed(0)
    block = get_family(config).build_block(config, 0).float()  # layer 0: sliding window 6
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.1)
        cache = [d.make_zeros() for d in block.cache_descriptors(1, 200)]
        assert cache[0].shape[2] == fam_b.WINDOW + DEFAULT_SLIDING_SLACK_TOKENS
        x = torch.randn(1, 150, config.hidden_size)
        block(x, cache=cache, position=0)
        limit = DEFAULT_SLIDING_SLACK_TOKENS + 1
        block(x[:, 150 - limit : 150 - limit + 1], cache=cache, position=150 - limit)  # served
        assert cache[2][0].tolist() == [150 - 70, 150 - limit + 1]  # held positions [80, 86): the ring's rule
        block(x[:, 150 - limit + 1 : 150], cache=cache, position=150 - limit + 1)  # back at 150
        with pytest.raises(ValueError, match=f"rollbacks of more than {limit} tokens"):
            block(x[:, 0:1], cache=cache, position=150 - limit - 1)
        with pytest.raises(ValueError, match="past the 150 tokens"):
            block(x[:, 0:1], cache=cache, position=151)


def test_gpt_oss_block_parameters_count_every_expert():
    config = _real_configs()["gpt_oss_20b"]
    H, inter, E = config.hidden_size, config.intermediate_size, config.num_local_experts
    experts_per_layer = E * (H * 2 * inter + 2 * inter + inter * H + H)
    params = count_block_parameters(config)
    assert params == sum(p.numel() for p in _block(config, 0).parameters())
    # gpt-oss-20b: most of a block's memory is experts
    assert 0.9 < experts_per_layer / params < 1.0
