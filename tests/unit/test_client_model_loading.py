"""The client loads only embeddings, norms and the LM head (sharded or single-file checkpoints, tied or separate
heads), and its local modules compute what the `transformers` model computes around the blocks."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file
from tests.helpers.prequantized import prequantized_checkpoints
from tests.helpers.tiny_models import make_tiny_model
from transformers import AutoModelForCausalLM

from corolla.client.config import ClientConfig
from corolla.client.models.distributed_model import LAYOUTS, DistributedModelForCausalLM
from corolla.client.models.generation import padding_groups
from corolla.client.routing.sequence_manager import RemoteSequenceManager
from corolla.models.config import load_config
from corolla.models.loading import CheckpointSource
from corolla.utils.errors import ConfigurationError


@pytest.mark.parametrize(("family", "sharded"), [("llama", True), ("qwen2", False), ("bloom", True), ("falcon", False)])
def test_client_weights_equal_the_checkpoint(tmp_path, family, sharded):
    path = make_tiny_model(family, tmp_path, sharded=sharded)
    reader = CheckpointSource(path)
    config = load_config(path)
    manager = RemoteSequenceManager(
        ClientConfig(), [f"x.{i}" for i in range(config.num_hidden_layers)], start_updates=False
    )
    model = DistributedModelForCausalLM(config, LAYOUTS[config.model_type], manager)
    requested: list[str] = []
    read = reader.read_named
    reader.read_named = lambda names: read(requested.extend(names) or names)
    model.load_client_weights(reader)
    assert requested and not [n for n in requested if ".layers." in n or ".h." in n]  # never a block tensor
    local = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.tensor([[5, 6, 7, 8]])
    hidden = torch.randn(1, 4, config.hidden_size)
    with torch.no_grad():
        base = local.base_model
        embed = base.get_input_embeddings()(ids)
        if family == "bloom":
            embed = base.word_embeddings_layernorm(embed)
        torch.testing.assert_close(model.embed(ids), embed)
        final_norm = base.norm if hasattr(base, "norm") else base.ln_f
        torch.testing.assert_close(model.head(hidden), local.lm_head(final_norm(hidden)))
    client_params = sum(p.numel() for p in model.parameters())
    assert client_params < sum(p.numel() for p in local.parameters())


def _client_model(path) -> DistributedModelForCausalLM:
    config = load_config(path)
    manager = RemoteSequenceManager(
        ClientConfig(), [f"x.{i}" for i in range(config.num_hidden_layers)], start_updates=False
    )
    model = DistributedModelForCausalLM(config, LAYOUTS[config.model_type], manager)
    model.load_client_weights(CheckpointSource(path))
    return model


@pytest.mark.parametrize("bits", [4, 8])
def test_a_head_saved_quantized_is_read_as_bitsandbytes_dequantizes_it(tmp_path, bits):
    """A checkpoint whose LM head bitsandbytes saved quantized (NF4 codes and statistics, or LLM.int8's) gives the
    client bitsandbytes' dequantized head. Before, NF4's packed codes failed at `copy_` and LLM.int8's [V, H] int8
    codes were copied in as the weights themselves (a head 127 / absmax times too large, silently)."""
    prequantized, dequantized = prequantized_checkpoints(tmp_path, bits, dtype=torch.float32, num_layers=2, head=True)
    assert {"lm_head.weight.absmax", "lm_head.SCB"} & set(load_file(str(prequantized / "model.safetensors")))
    model = _client_model(prequantized)
    want = load_file(str(dequantized / "model.safetensors"))["lm_head.weight"]
    torch.testing.assert_close(model.lm_head.weight, want, atol=0, rtol=0)
    torch.testing.assert_close(model.embeddings.weight, _client_model(dequantized).embeddings.weight)


def test_a_head_of_another_shape_is_refused(tmp_path):
    """A checkpoint (bytes from the hub) whose head is [1, H]: refused naming its shape; `copy_` broadcast it over
    every row of the [V, H] head before, a model that emits one logit for every token."""
    path = make_tiny_model("llama", tmp_path)
    tensors = load_file(str(path / "model.safetensors"))
    tensors["lm_head.weight"] = tensors["lm_head.weight"][:1].clone()
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"head is \[1, "):
        _client_model(path)
    tensors["model.norm.weight"] = tensors["model.norm.weight"][:1].clone()
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"model.norm.weight is \[1\]"):
        _client_model(path)


def test_reader_reads_only_what_is_asked(tmp_path):
    path = make_tiny_model("llama", tmp_path, sharded=True)
    tensors = CheckpointSource(path).read_named(["model.embed_tokens.weight", "model.norm.weight", "no.such.tensor"])
    assert set(tensors) == {"model.embed_tokens.weight", "model.norm.weight"}
    with pytest.raises(ConfigurationError):  # was FileNotFoundError: one reader (docs/decisions/0052)
        CheckpointSource(tmp_path).read_named(["model.norm.weight"])


def test_padding_groups():
    mask = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1], [0, 0, 1, 1], [0, 1, 1, 1]])
    groups = [(rows.tolist(), pad) for rows, pad in padding_groups(mask)]
    assert groups == [([1], 0), ([3], 1), ([0, 2], 2)]
    with pytest.raises(ValueError, match="left padding"):
        padding_groups(torch.tensor([[1, 1, 0]]))
