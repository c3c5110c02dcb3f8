"""Fixtures several integration files share: the tiny Llama checkpoint their in-process server loads, its blocks
loaded here as the reference, and one client of the module's own `server` fixture (a module's fixture of the same
name replaces any of them)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from corolla.models.loading import load_pretrained_block
from helpers.swarm import ClientThread, connected_clients
from helpers.tiny_models import hf_model, make_tiny_model


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama checkpoint (4 layers), one per module."""
    return make_tiny_model("llama", tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="module")
def blocks(model_path: Path, server: Any) -> list[torch.nn.Module]:
    """Every block of `model_path`, float32 here in the test process: the reference the module's `server` is
    compared with."""
    config = server.model_config
    return [
        load_pretrained_block(model_path, i, config=config, torch_dtype=torch.float32).eval()
        for i in range(config.num_hidden_layers)
    ]


@pytest.fixture(scope="module")
def local(model_path: Path) -> Any:
    """transformers' model of `model_path` (float32): the reference of whole generations."""
    return hf_model(model_path)


@pytest.fixture(scope="module")
def client(server: Any) -> Iterator[ClientThread]:
    """One `ClientThread` (a libp2p identity of its own) connected to the module's in-process `server`."""
    with connected_clients(server, 1) as (only,):
        yield only
