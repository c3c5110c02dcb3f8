"""Training through a 2-server loopback swarm, the Llama/Mistral/Qwen2/Mixtral/Falcon/Bloom families: a deep-prompt-
tuned causal LM with every client-side weight trainable gets the loss and gradients of local `transformers` fp32
(relative 1e-4) for its prefix, its deep prompts (sent per block to both servers), embeddings, norms and head."""

from __future__ import annotations

import pytest

from helpers.tiny_models import FAMILIES
from helpers.training import check_family_gradients, split_swarm

pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def swarm_and_paths(tmp_path_factory: pytest.TempPathFactory):
    with split_swarm(tmp_path_factory, FAMILIES) as swarm_and_paths:
        yield swarm_and_paths


@pytest.mark.parametrize("family", FAMILIES)
def test_prompt_and_client_gradients_equal_local_transformers(swarm_and_paths, family):
    swarm, paths = swarm_and_paths
    check_family_gradients(swarm, paths[family], split=family == FAMILIES[0])
