"""Every family's block, loaded from a tiny random checkpoint, computes what the transformers decoder layer of the
same family computes: forward, KV-cached inference steps with a rollback, and gradients."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from corolla.models.config import load_config
from corolla.models.loading import load_pretrained_block
from helpers.hf_equivalence import SEQ, check_block_matches_transformers
from helpers.tiny_models import (
    FAMILIES,
    capture_hf_layer,
    make_tiny_model,
    save_tiny_model,
    tiny_config,
)

LAYER = 1


pytestmark = pytest.mark.usefixtures("single_torch_thread")


@pytest.mark.parametrize("family", FAMILIES)
def test_block_matches_transformers(family, tmp_path):
    check_block_matches_transformers(make_tiny_model(family, tmp_path))


@pytest.mark.parametrize("family", FAMILIES)
def test_sharded_checkpoint_block_matches_transformers(family, tmp_path):
    check_block_matches_transformers(make_tiny_model(family, tmp_path, sharded=True), check_grads=False)


def _variant(family: str, **overrides):
    config = tiny_config(family, num_layers=2)
    for key, value in overrides.items():
        setattr(config, key, value)
    return config


VARIANTS = {
    "llama3-rope": lambda: _variant(
        "llama",
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8,
        },
    ),
    "linear-rope": lambda: _variant(
        "llama", rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}
    ),
    "llama-biases": lambda: _variant("llama", attention_bias=True, mlp_bias=True),
    "qwen2-sliding": lambda: _variant(
        "qwen2",
        use_sliding_window=True,
        sliding_window=6,
        max_window_layers=1,
        layer_types=["full_attention", "sliding_attention"],
    ),
    "falcon-alibi-sequential": lambda: _variant(
        "falcon",
        new_decoder_architecture=False,
        multi_query=False,
        parallel_attn=False,
        alibi=True,
        bias=True,
        num_kv_heads=4,
    ),
    "falcon-mha-parallel-rotary": lambda: _variant(
        "falcon", new_decoder_architecture=False, multi_query=False, parallel_attn=True, bias=True, num_kv_heads=4
    ),
    "bloom-post-ln-residual": lambda: _variant("bloom", apply_residual_connection_post_layernorm=True),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_config_variants_match_transformers(variant, tmp_path):
    config = VARIANTS[variant]()
    check_block_matches_transformers(
        save_tiny_model(config, tmp_path / variant), check_grads=variant.startswith("falcon")
    )


@pytest.mark.parametrize("family", FAMILIES)
def test_bfloat16_block_matches_transformers_in_bfloat16(family, tmp_path):
    """Same numerics in bf16 (norms in fp32 where the reference does them, rotary tables cast like it): at most
    about one bf16 rounding step apart, with and without cache."""
    model_dir = make_tiny_model(family, tmp_path, dtype=torch.bfloat16)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
    block = load_pretrained_block(model_dir, LAYER, config=load_config(model_dir), torch_dtype="auto")
    assert block.dtype == torch.bfloat16
    x, ref, _ = capture_hf_layer(hf, LAYER, torch.randint(3, 300, (2, SEQ)))
    with torch.no_grad():
        torch.testing.assert_close(block(x), ref, atol=0.07, rtol=0.01)
        cache = [d.make_zeros() for d in block.cache_descriptors(2, SEQ)]
        steps = [block(x[:, :10], cache=cache, position=0), block(x[:, 10:], cache=cache, position=10)]
        torch.testing.assert_close(torch.cat(steps, dim=1), ref, atol=0.07, rtol=0.01)
