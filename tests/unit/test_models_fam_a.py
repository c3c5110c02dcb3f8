"""Qwen3, Qwen3-MoE, Phi-3 and DeepSeek-V3 blocks, loaded from tiny random checkpoints, compute what the
transformers decoder layer computes: forward (fp32, atol 1e-4), KV-cached steps with a rollback, gradients w.r.t.
the inputs and the weights; plus config variants (dense/sparse layers, q_proj without LoRA, partial rotary)."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

import helpers.tiny_models_fam_a as fam_a
from corolla.models.config import load_config
from corolla.models.loading import load_pretrained_block
from corolla.models.registry import get_family
from corolla.models.tensor_parallel import make_tensor_parallel
from helpers.hf_equivalence import check_block_matches_transformers
from helpers.tiny_models import hf_layers, make_tiny_model, save_tiny_model

pytestmark = pytest.mark.usefixtures("single_torch_thread")


def save_with_random_router_bias(config, out: Path) -> Path:
    """A DeepSeek-V3 checkpoint whose `e_score_correction_bias` is random (transformers initializes it to zeros,
    which would leave the biased choice untested); large enough to change which experts win."""
    save_tiny_model(config, out)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    generator = torch.Generator().manual_seed(7)
    for layer in hf_layers(model):
        gate = getattr(layer.mlp, "gate", None)
        if gate is not None and hasattr(gate, "e_score_correction_bias"):
            gate.e_score_correction_bias.copy_(torch.randn(gate.e_score_correction_bias.shape, generator=generator))
    model.save_pretrained(out)
    return out


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe", "phi3"])
def test_block_matches_transformers(family, tmp_path):
    check_block_matches_transformers(make_tiny_model(family, tmp_path, num_layers=2))


def test_qwen3_moe_dense_layer_matches_transformers(tmp_path):
    check_block_matches_transformers(make_tiny_model("qwen3_moe", tmp_path, num_layers=2), layer=0, check_grads=False)


def test_qwen3_moe_without_topk_renormalization(tmp_path):
    config = fam_a.qwen3_moe_config(2)
    config.norm_topk_prob = False
    config.mlp_only_layers = []
    check_block_matches_transformers(save_tiny_model(config, tmp_path / "m"), check_grads=False)


def test_deepseek_v3_moe_layer_matches_transformers(tmp_path):
    check_block_matches_transformers(save_with_random_router_bias(fam_a.deepseek_v3_config(2), tmp_path / "m"))


def test_deepseek_v3_dense_layer_and_plain_q_proj(tmp_path):
    config = fam_a.deepseek_v3_config(2)
    config.q_lora_rank = None
    config.rope_interleave = False
    check_block_matches_transformers(save_tiny_model(config, tmp_path / "m"), layer=0)


def test_phi3_partial_rotary_and_sliding_window(tmp_path):
    config = fam_a.phi3_config(2)
    config.rope_parameters = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.75}
    config.sliding_window = 6
    check_block_matches_transformers(save_tiny_model(config, tmp_path / "m"), check_grads=False)


def test_deepseek_v3_yarn_rope_with_mscale(tmp_path):
    """DeepSeek-V3's published rope: YaRN (factor 40) with mscale_all_dim, which also scales the softmax."""
    config = fam_a.deepseek_v3_config(2)
    config.rope_parameters = {
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "original_max_position_embeddings": 8,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
    }  # fmt: skip
    check_block_matches_transformers(save_with_random_router_bias(config, tmp_path / "m"), check_grads=False)


def test_deepseek_v3_router_bias_changes_the_choice(tmp_path):
    """The correction bias decides which experts run: zeroing it changes the output (so the test above covers it)."""
    model_dir = save_with_random_router_bias(fam_a.deepseek_v3_config(2), tmp_path / "m")
    block = load_pretrained_block(model_dir, 1, config=load_config(model_dir), torch_dtype=torch.float32)
    x = torch.randn(1, 7, 64)
    with torch.no_grad():
        before = block(x)
        block.mlp.e_score_correction_bias.zero_()
        assert not torch.allclose(block(x), before, atol=1e-3)


@pytest.mark.parametrize("original_max", [8, 64])  # 8: past the original context (long factors); 64: short ones
def test_phi3_longrope_with_partial_rotary(original_max, tmp_path):
    """Phi-4-mini's combination: LongRoPE over the first 3/4 of each head."""
    config = fam_a.phi3_config(2)
    half = 6  # head_dim 16 * 0.75 / 2
    config.rope_parameters = {
        "rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
        "short_factor": [1.0 + 0.1 * i for i in range(half)], "long_factor": [1.0 + 2.0 * i for i in range(half)],
        "original_max_position_embeddings": original_max,
    }  # fmt: skip
    config.original_max_position_embeddings = original_max
    check_block_matches_transformers(save_tiny_model(config, tmp_path / "m"), check_grads=False)


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe", "phi3"])
def test_tensor_parallel_split_equals_unsplit(family, tmp_path):
    """Two CPU shards: per-head q/k norms travel with every shard, the un-renormalized router option too."""
    config = fam_a.tiny_config_of(family)
    if family == "qwen3_moe":
        config.norm_topk_prob = False
    if family == "phi3":
        config.rope_parameters = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}
    model_dir = save_tiny_model(config, tmp_path / "m")
    block = load_pretrained_block(model_dir, 1, config=load_config(model_dir), torch_dtype=torch.float32)
    split = make_tensor_parallel(copy.deepcopy(block), ["cpu", "cpu"])
    x = torch.randn(2, 9, 64)
    with torch.no_grad():
        torch.testing.assert_close(split(x), block(x), atol=1e-5, rtol=0)
        caches = [[d.make_zeros() for d in b.cache_descriptors(2, 16)] for b in (block, split)]
        for position, n in ((0, 6), (6, 1), (3, 2)):  # the last one rolls back
            chunk = x[:, position : position + n]
            ours = split(chunk, cache=caches[1], position=position)
            torch.testing.assert_close(ours, block(chunk, cache=caches[0], position=position), atol=1e-5, rtol=0)


def test_tensor_parallel_refuses_latent_attention():
    config = fam_a.deepseek_v3_config(2)
    with torch.device("meta"):
        block = get_family(config).build_block(config, 1)
    with pytest.raises(ValueError, match="can't split LatentAttention"):
        make_tensor_parallel(block, ["meta", "meta"])
