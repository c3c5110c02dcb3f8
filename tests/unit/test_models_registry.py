"""Registry, config and dtype rules, DHT prefixes, KV heads, sizing, quantization types, input validation, and
that importing corolla never imports bitsandbytes."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
import transformers as tf

from corolla.models.config import default_dht_prefix, load_config, resolve_block_dtype
from corolla.models.quantization import QuantType, quantize_block
from corolla.models.registry import SUPPORTED_MODEL_TYPES, get_family
from corolla.models.sizing import block_size_bytes, count_block_parameters, kv_cache_bytes_per_token
from helpers.tiny_models import make_tiny_model, tiny_config


def test_families_and_prefixes():
    assert {"llama", "mistral", "qwen2", "mixtral", "falcon", "bloom"} <= set(SUPPORTED_MODEL_TYPES)
    assert get_family("mistral").family == get_family("qwen2").family == "llama"
    assert get_family(tiny_config("falcon")).block_prefix == "transformer.h"
    assert get_family("bloom").block_prefix == "h" and get_family("mixtral").block_prefix == "model.layers"
    with pytest.raises(ValueError, match="Unsupported model_type 'gpt2'.*llama"):
        get_family(tf.GPT2Config())


@pytest.mark.parametrize(
    "model_type, repo, prefix",
    [
        ("llama", "meta-llama/Meta-Llama-3.1-405B-Instruct", "Meta-Llama-3-1-405B-Instruct-hf"),
        ("llama", "meta-llama/Llama-2-70b-hf", "Llama-2-70b-hf"),
        ("bloom", "bigscience/bloom", "bigscience/bloom-petals"),
        ("bloom", "bigscience/bloom-7b1", "bigscience/bloom-7b1-petals"),
        ("falcon", "tiiuae/falcon-180B-chat", "falcon-180B-chat"),
        ("mixtral", "mistralai/Mixtral-8x22B-Instruct-v0.1", "mistralai/Mixtral-8x22B-Instruct-v0-1"),
    ],
)
def test_default_dht_prefix_for_hub_names(model_type, repo, prefix):
    assert default_dht_prefix(repo, tf.AutoConfig.for_model(model_type)) == prefix


def test_default_dht_prefix_for_local_directories(tmp_path):
    model_dir = make_tiny_model("llama", tmp_path)
    renamed = model_dir.rename(tmp_path / "my.tiny.llama")
    assert default_dht_prefix(renamed, load_config(renamed)) == "my-tiny-llama"  # no "-hf" rule for local paths


def test_kv_heads_per_family():
    mixtral = tf.MixtralConfig(hidden_size=6144, num_attention_heads=48, num_key_value_heads=8)
    assert get_family(mixtral).num_kv_heads(mixtral) == 8  # not 48, unlike the reference
    for family, expected in [("llama", 2), ("falcon", 2), ("falcon_mq", 1), ("bloom", 4)]:
        config = tiny_config(family)
        assert get_family(config).num_kv_heads(config) == expected
    old_falcon = tf.FalconConfig(num_attention_heads=8, new_decoder_architecture=False, multi_query=False)
    assert get_family(old_falcon).num_kv_heads(old_falcon) == 8


def test_dtype_resolution():
    fp32, fp16, bf16 = (tf.LlamaConfig(dtype=d) for d in ("float32", "float16", "bfloat16"))
    assert resolve_block_dtype(fp32, "auto", device="cuda") == torch.bfloat16
    assert resolve_block_dtype(fp16, "auto", device="cuda") == torch.float16
    assert resolve_block_dtype(bf16, None, device="cpu") == torch.bfloat16
    assert resolve_block_dtype(fp16, "float32", device="cpu") == torch.float32
    assert resolve_block_dtype(fp32, torch.float16, device="cuda") == torch.float16
    assert resolve_block_dtype(bf16, "auto", device="mps") == torch.float16
    with pytest.raises(ValueError, match="float16 is not supported on CPU"):
        resolve_block_dtype(fp32, "float16", device="cpu")
    with pytest.raises(ValueError, match="float16 is not supported on CPU"):
        resolve_block_dtype(fp16, "auto", device="cpu")
    with pytest.raises(ValueError, match="Unsupported torch_dtype 'int8'"):
        resolve_block_dtype(fp32, "int8")


def test_load_config_rejects_unsupported_models(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ValueError, match="Unsupported model_type 'gpt2'"):
        load_config(tmp_path)


def test_sizing_and_cache_descriptors():
    config = tiny_config("llama")  # hidden 64, 4 heads, 2 KV heads (head_dim 16), intermediate 128
    n_params = 64 * 64 * 2 + 64 * 32 * 2 + 3 * 64 * 128 + 2 * 64
    assert count_block_parameters(config) == n_params
    assert block_size_bytes(config, torch.bfloat16) == round(n_params * 2 * 1.01)
    assert block_size_bytes(config, torch.bfloat16, "int8") == round(n_params * 1.01)
    assert block_size_bytes(config, torch.float32, QuantType.NF4) == round(n_params * 4.25 / 8 * 1.01)
    assert kv_cache_bytes_per_token(config, torch.bfloat16) == 2 * 2 * 16 * 2
    block = get_family(config).build_block(config, 0).to(torch.bfloat16)
    descriptors = block.cache_descriptors(3, 100)
    assert [d.shape for d in descriptors] == [(3, 2, 100, 16)] * 2
    assert all(d.dtype == torch.bfloat16 for d in descriptors)
    assert sum(d.nbytes for d in descriptors) == kv_cache_bytes_per_token(config, torch.bfloat16) * 3 * 100


def test_forward_validates_inputs():
    config = tiny_config("llama")
    block = get_family(config).build_block(config, 0)
    cache = [d.make_zeros() for d in block.cache_descriptors(1, 4)]
    with pytest.raises(ValueError, match="hidden_states must be"):
        block(torch.zeros(1, 2, 32))
    with pytest.raises(ValueError, match="position must be >= 0"):
        block(torch.zeros(1, 2, 64), cache=cache, position=-1)
    with pytest.raises(ValueError, match="exceeds the cache length 4"):
        block(torch.zeros(1, 2, 64), cache=cache, position=3)
    assert block(torch.zeros(1, 0, 64), cache=cache, position=2).shape == (1, 0, 64)  # zero-token steps are valid


def test_quant_types():
    assert QuantType.parse("NF4") is QuantType.NF4 and QuantType.parse(None) is QuantType.NONE
    assert QuantType.INT8.label == "int8"
    with pytest.raises(ValueError, match="Unknown quant_type 'int4'"):
        QuantType.parse("int4")
    config = tiny_config("llama")
    block = get_family(config).build_block(config, 0)
    assert quantize_block(block, "none", "cpu") is block
    with pytest.raises(ValueError, match="needs a CUDA device"):
        quantize_block(block, QuantType.INT8, "cpu")


def test_importing_corolla_never_imports_bitsandbytes():
    code = (
        "import sys, corolla, corolla.models.registry, corolla.models.loading, corolla.models.quantization, "
        "corolla.models.lora, corolla.models.sizing, corolla.models.tensor_parallel; "
        "assert 'bitsandbytes' not in sys.modules, 'bitsandbytes was imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


@pytest.mark.parametrize("family", ["llama", "falcon", "bloom"])
def test_backward_after_inference_mode_forward(family):
    """Tables cached during an inference-mode call (rotary cos/sin) must not break a later autograd pass."""
    config = tiny_config(family)
    block = get_family(config).build_block(config, 0)
    x = torch.randn(1, 5, 64)
    with torch.inference_mode():
        block(x)
        block(x[:, :2], cache=[d.make_zeros() for d in block.cache_descriptors(1, 8)], position=0)
    leaf = x.clone().requires_grad_(True)
    block(leaf).sum().backward()
    assert leaf.grad is not None and leaf.grad.abs().sum() > 0


def test_dynamic_rope_scaling_matches_transformers_formula():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from corolla.models.positions import RotaryEmbedding, rope_parameters

    config = tf.LlamaConfig(
        hidden_size=64,
        num_attention_heads=4,
        max_position_embeddings=16,
        rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
    )
    rotary = RotaryEmbedding(16, rope_parameters(config), config.max_position_embeddings)
    cpu = torch.device("cpu")
    for seq_len in (10, 16, 40):
        expected, _ = ROPE_INIT_FUNCTIONS["dynamic"](config, cpu, seq_len=seq_len)
        torch.testing.assert_close(rotary.inv_freq(cpu, seq_len), expected)
    assert not torch.equal(rotary.inv_freq(cpu, 40), rotary.inv_freq(cpu, 16))  # scaled beyond the trained length
    with pytest.raises(ValueError, match="Unsupported rope type 'longrope'"):
        rope_parameters(type("Config", (), {"rope_parameters": {"rope_type": "longrope", "rope_theta": 1.0}})())
