"""Every served family through the client: one server per family (tiny models, one shared bootstrap node; the
servers run in this process: what they serve is under test, not their process); logits match local `transformers`
(fp32, atol 1e-3) and greedy generation is token-identical."""

from __future__ import annotations

import pytest
import torch
from tests.helpers.swarm import bootstrapped, inprocess_servers
from tests.helpers.tiny_models import make_tiny_model
from transformers import AutoModelForCausalLM

from corolla.client import AutoDistributedModelForCausalLM, ClientConfig

pytestmark = pytest.mark.timeout(240)

FAMILIES = ["mistral", "qwen2", "mixtral", "falcon", "falcon_mq", "bloom"]  # llama: test_client_generation.py


@pytest.fixture(scope="module")
def swarm_with_models(tmp_path_factory: pytest.TempPathFactory):
    models_dir = tmp_path_factory.mktemp("models")
    paths = {family: make_tiny_model(family, models_dir, num_layers=2) for family in FAMILIES}
    with bootstrapped(tmp_path_factory.mktemp("swarm")) as swarm:
        cache_dir = tmp_path_factory.mktemp("cache")
        with inprocess_servers([(path, "0:2") for path in paths.values()], cache_dir, swarm.initial_peers):
            yield swarm, paths


@pytest.mark.parametrize("family", FAMILIES)
def test_family_logits_and_greedy_match_local(swarm_with_models, family):
    swarm, paths = swarm_with_models
    local = AutoModelForCausalLM.from_pretrained(paths[family], dtype=torch.float32).eval()
    ids = torch.tensor([[3, 14, 15, 92, 65, 35]])
    config = ClientConfig(max_retries=3, min_backoff_s=0.2)
    with AutoDistributedModelForCausalLM.from_pretrained(
        paths[family], initial_peers=swarm.initial_peers, client_config=config
    ) as model:
        with torch.no_grad():
            torch.testing.assert_close(model(ids).logits, local(ids).logits, atol=1e-3, rtol=0)
            expected = local.generate(ids, max_new_tokens=8, do_sample=False)
        assert model.generate(ids, max_new_tokens=8, do_sample=False).tolist() == expected.tolist()
