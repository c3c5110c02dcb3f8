"""A server started on a pre-quantized bitsandbytes checkpoint (NF4, LLM.int8; its LM head quantized too, which the
client reads) serves it through the client as the 16-bit checkpoint of bitsandbytes' dequantized weights: the same
logits (fp32 servers, atol 1e-3) and greedy tokens as local `transformers` on that checkpoint."""

from __future__ import annotations

import pytest
import torch
from tests.helpers.prequantized import prequantized_checkpoints
from tests.helpers.swarm import bootstrapped, inprocess_servers
from transformers import AutoModelForCausalLM

from corolla.client import AutoDistributedModelForCausalLM, ClientConfig

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory):
    models = tmp_path_factory.mktemp("models")
    paths = {
        bits: prequantized_checkpoints(models, bits, dtype=torch.float32, num_layers=2, head=True) for bits in (4, 8)
    }
    with bootstrapped(tmp_path_factory.mktemp("swarm")) as swarm:
        cache_dir = tmp_path_factory.mktemp("cache")
        spans = [(prequantized, "0:2") for prequantized, _ in paths.values()]
        with inprocess_servers(spans, cache_dir, swarm.initial_peers):
            yield swarm, paths


@pytest.mark.parametrize("bits", [4, 8])
def test_a_prequantized_checkpoint_serves_its_dequantized_model(served, bits):
    swarm, paths = served
    prequantized, dequantized = paths[bits]
    local = AutoModelForCausalLM.from_pretrained(dequantized, dtype=torch.float32).eval()
    ids = torch.tensor([[3, 14, 15, 92, 65, 35]])
    config = ClientConfig(max_retries=3, min_backoff_s=0.2)
    with AutoDistributedModelForCausalLM.from_pretrained(
        prequantized, initial_peers=swarm.initial_peers, client_config=config
    ) as model:
        with torch.no_grad():
            torch.testing.assert_close(model(ids).logits, local(ids).logits, atol=1e-3, rtol=0)
            expected = local.generate(ids, max_new_tokens=8, do_sample=False)
        assert model.generate(ids, max_new_tokens=8, do_sample=False).tolist() == expected.tolist()
