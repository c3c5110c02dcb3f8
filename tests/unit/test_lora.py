"""LoRA adapters built offline with peft change our blocks' outputs exactly as peft changes the transformers
layers; adapters are chosen per request by name, work with tensor parallelism, and pickled ones are refused."""

from __future__ import annotations

import copy

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

# importing these registers the newer families' tiny configs with make_tiny_model
import helpers.tiny_models_fam_a
import helpers.tiny_models_fam_b  # noqa: F401
from corolla.models.block_base import using_adapter
from corolla.models.config import load_config
from corolla.models.lora import add_adapter, load_adapter
from corolla.models.tensor_parallel import make_tensor_parallel
from helpers.tiny_models import capture_hf_layer, make_tiny_model

LAYER = 2
TARGETS = {
    "llama": ["q_proj", "v_proj", "o_proj", "gate_proj", "down_proj"],
    "falcon": ["query_key_value", "dense", "dense_h_to_4h"],
    "bloom": ["query_key_value", "dense_4h_to_h"],
    "mixtral": ["k_proj", "o_proj"],
    "qwen3": ["q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "down_proj"],
    "qwen3_moe": ["q_proj", "k_proj", "o_proj"],
    "phi3": ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"],
    "gemma2": ["q_proj", "v_proj", "o_proj", "gate_proj", "down_proj"],
    "gemma3_text": ["q_proj", "k_proj", "o_proj", "up_proj"],
    "deepseek_v3": ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"],
    "gpt_oss": ["q_proj", "k_proj", "v_proj", "o_proj"],
}


pytestmark = pytest.mark.usefixtures("single_torch_thread")


def _make_adapter(model_dir, out_dir, targets, seed: int, **lora_kwargs):
    """Saves a peft adapter with random (non-zero) A and B; returns the peft-wrapped transformers model."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    config = LoraConfig(
        r=4, lora_alpha=8, target_modules=targets, lora_dropout=0.0, init_lora_weights=False, **lora_kwargs
    )
    peft_model = get_peft_model(model, config).eval()
    peft_model.save_pretrained(out_dir)
    return peft_model


def _load_block(model_dir):
    from corolla.models.loading import load_pretrained_block

    return load_pretrained_block(model_dir, LAYER, config=load_config(model_dir), torch_dtype=torch.float32)


@pytest.mark.parametrize("family", sorted(TARGETS))
def test_adapter_matches_peft(family, tmp_path):
    model_dir = make_tiny_model(family, tmp_path)
    peft_model = _make_adapter(model_dir, tmp_path / "adapter", TARGETS[family], seed=1)
    ids = torch.randint(3, 300, (2, 9))
    x, ref_adapted, _ = capture_hf_layer(peft_model.base_model.model, LAYER, ids)
    with peft_model.disable_adapter():
        x_plain, ref_plain, _ = capture_hf_layer(peft_model.base_model.model, LAYER, ids)

    block = _load_block(model_dir)
    add_adapter(block, "my/adapter.v1", load_adapter(tmp_path / "adapter", LAYER))
    with torch.no_grad():
        with using_adapter("my/adapter.v1"):
            torch.testing.assert_close(block(x), ref_adapted, atol=1e-4, rtol=0)
            cache = [d.make_zeros() for d in block.cache_descriptors(2, 16)]
            first = block(x[:, :6], cache=cache, position=0)
            second = block(x[:, 6:], cache=cache, position=6)
            torch.testing.assert_close(torch.cat([first, second], 1), ref_adapted, atol=1e-3, rtol=0)
        with using_adapter(""):
            torch.testing.assert_close(block(x_plain), ref_plain, atol=1e-4, rtol=0)
    assert (ref_adapted - ref_plain).abs().max() > 1e-3  # the adapter really changes the layer


def test_two_adapters_selected_per_request_and_unknown_name(tmp_path):
    model_dir = make_tiny_model("llama", tmp_path)
    peft_a = _make_adapter(model_dir, tmp_path / "a", ["q_proj", "v_proj"], seed=1)
    peft_b = _make_adapter(model_dir, tmp_path / "b", ["up_proj"], seed=2, use_rslora=True)
    ids = torch.randint(3, 300, (1, 7))
    x_a, ref_a, _ = capture_hf_layer(peft_a.base_model.model, LAYER, ids)
    x_b, ref_b, _ = capture_hf_layer(peft_b.base_model.model, LAYER, ids)  # earlier layers differ too

    block = _load_block(model_dir)
    add_adapter(block, "a", load_adapter(tmp_path / "a", LAYER))
    add_adapter(block, "b", load_adapter(tmp_path / "b", LAYER))
    with torch.no_grad():
        with using_adapter("b"):
            torch.testing.assert_close(block(x_b), ref_b, atol=1e-4, rtol=0)
        with using_adapter("a"):
            torch.testing.assert_close(block(x_a), ref_a, atol=1e-4, rtol=0)
        with pytest.raises(KeyError, match=r"'nope'.*\['a', 'b'\]"), using_adapter("nope"):
            block(x_a)
    a_weights = load_adapter(tmp_path / "a", LAYER)
    hidden, r = 64, 4
    num_parameters = sum(a.numel() + b.numel() for a, b, _ in a_weights.modules.values())
    assert num_parameters == r * (2 * hidden + hidden + 32)  # q: 64->64, v: 64->32


def test_adapter_on_tensor_parallel_block_equals_unsplit(tmp_path):
    model_dir = make_tiny_model("falcon", tmp_path)
    _make_adapter(model_dir, tmp_path / "adapter", ["query_key_value", "dense", "dense_4h_to_h"], seed=3)
    weights = load_adapter(tmp_path / "adapter", LAYER)
    block = _load_block(model_dir)
    tp_block = make_tensor_parallel(copy.deepcopy(block), ["cpu", "cpu"])
    add_adapter(block, "x", weights)
    add_adapter(tp_block, "x", weights)
    x = torch.randn(2, 5, 64)
    with torch.no_grad(), using_adapter("x"):
        torch.testing.assert_close(tp_block(x), block(x), atol=1e-5, rtol=0)


def test_pickled_adapter_is_refused(tmp_path):
    model_dir = make_tiny_model("llama", tmp_path)
    _make_adapter(model_dir, tmp_path / "adapter", ["q_proj"], seed=1)
    from safetensors.torch import load_file

    tensors = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    (tmp_path / "adapter" / "adapter_model.safetensors").unlink()
    torch.save(tensors, tmp_path / "adapter" / "adapter_model.bin")
    with pytest.raises(ValueError, match="pickled adapters are refused"):
        load_adapter(tmp_path / "adapter", LAYER)
