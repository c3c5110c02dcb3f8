"""The client loads only embeddings, norms and the LM head (sharded or single-file checkpoints, tied or separate
heads), and its local modules compute what the `transformers` model computes around the blocks."""

from __future__ import annotations

import pytest
import torch
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
