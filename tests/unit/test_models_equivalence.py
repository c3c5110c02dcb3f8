"""Every family's block, loaded from a tiny random checkpoint, computes what the transformers decoder layer of the
same family computes: forward, KV-cached inference steps with a rollback, and gradients."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from corolla.models.config import load_config
from corolla.models.loading import load_pretrained_block
from helpers.tiny_models import (
    FAMILIES,
    capture_hf_layer,
    hf_layers,
    make_tiny_model,
    save_tiny_model,
    tiny_config,
    torch_threads,
)

LAYER = 1
SEQ = 13  # = the inference steps 10, 1, 1, 1
ROLLBACK_TO, ROLLBACK_TOKENS = 8, 3


@pytest.fixture(autouse=True, scope="module")
def _single_thread():
    with torch_threads(1):
        yield


def _check_block(model_dir, *, check_grads: bool = True) -> None:
    torch.manual_seed(123)
    config = load_config(model_dir)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    block = load_pretrained_block(model_dir, LAYER, config=config, torch_dtype=torch.float32)
    ids = torch.randint(3, config.vocab_size, (2, SEQ))
    x, ref, ref_kwargs = capture_hf_layer(hf, LAYER, ids)  # [2, SEQ, H]

    with torch.no_grad():  # forward without cache
        torch.testing.assert_close(block(x), ref, atol=1e-4, rtol=0)

        cache = [d.make_zeros() for d in block.cache_descriptors(2, 32)]  # inference steps 10, 1, 1, 1
        position = 0
        for n in (10, 1, 1, 1):
            out = block(x[:, position : position + n], cache=cache, position=position)
            torch.testing.assert_close(out, ref[:, position : position + n], atol=1e-3, rtol=0)
            position += n

        # Rollback: continue from position 8 with different tokens; the stale cache entries beyond must not count.
        ids2 = torch.cat([ids[:, :ROLLBACK_TO], torch.randint(3, config.vocab_size, (2, ROLLBACK_TOKENS))], dim=1)
        x2, ref2, _ = capture_hf_layer(hf, LAYER, ids2)
        out = block(x2[:, ROLLBACK_TO:], cache=cache, position=ROLLBACK_TO)
        torch.testing.assert_close(out, ref2[:, ROLLBACK_TO:], atol=1e-3, rtol=0)

    if not check_grads:
        return
    block.requires_grad_(True)
    weight = torch.randn_like(ref)
    ours_in = x.clone().requires_grad_(True)
    (block(ours_in) * weight).sum().backward()
    layer = hf_layers(hf)[LAYER]
    ref_in = x.clone().requires_grad_(True)
    ref_out = layer(ref_in, **ref_kwargs)
    ref_out = ref_out[0] if isinstance(ref_out, tuple) else ref_out
    (ref_out * weight).sum().backward()
    torch.testing.assert_close(ours_in.grad, ref_in.grad, atol=1e-4, rtol=1e-4)

    ref_grads = block.normalize_checkpoint_names({n: p.grad for n, p in layer.named_parameters()})
    params = dict(block.named_parameters())
    layout = block.checkpoint_layout()
    assert set(layout) <= set(ref_grads)
    for name, target in layout.items():
        grad = params[target.param].grad
        grad = grad if target.rows is None else grad[target.rows]
        torch.testing.assert_close(grad, ref_grads[name], atol=1e-4, rtol=1e-4, msg=f"grad of {name}")


@pytest.mark.parametrize("family", FAMILIES)
def test_block_matches_transformers(family, tmp_path):
    _check_block(make_tiny_model(family, tmp_path))


@pytest.mark.parametrize("family", FAMILIES)
def test_sharded_checkpoint_block_matches_transformers(family, tmp_path):
    _check_block(make_tiny_model(family, tmp_path, sharded=True), check_grads=False)


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
    _check_block(save_tiny_model(config, tmp_path / variant), check_grads=variant.startswith("falcon"))


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
