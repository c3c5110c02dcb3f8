"""A float16 server after a span whose outputs it cannot hold (real servers, decision 0170): a tiny llama whose
block 1 writes hidden states ~1e6 into the residual (legal in float32, past float16's +-65504), served 0:2 in float32
and 2:4 twice, once in float16 (announced fastest, so routes go through it; CPU float16 allowed by the test) and
once in float32. The float16 server
refused the float32 client's inputs (`check_castable`) and the client banned it for the refusal, in a session's steps
and in a forward pass; now the client does not send it what it cannot hold, routes around it, and bans nobody."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file
from tests.helpers.float16_swarm import FAST_CLIENT, float16_chain, greedy_through
from tests.helpers.tiny_models import hf_greedy, hf_model, make_tiny_model

from corolla.client import AutoDistributedModelForCausalLM

pytestmark = pytest.mark.timeout(300)

PROMPT = torch.tensor([[1, 8, 27, 64, 125]])
NEW_TOKENS = 6
SCALE = 1e6  # block 1's MLP output weights: its outputs (the residual after it) reach ~1e6


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory):
    path = make_tiny_model("llama", tmp_path_factory.mktemp("models"), seed=7)
    (weights_file,) = path.glob("*.safetensors")
    weights = load_file(weights_file)
    weights["model.layers.1.mlp.down_proj.weight"] *= SCALE
    save_file(weights, weights_file, metadata={"format": "pt"})
    return path


@pytest.fixture(scope="module")
def swarm(model_path, tmp_path_factory: pytest.TempPathFactory):
    with float16_chain(model_path, tmp_path_factory) as (swarm, narrow, _):
        swarm.narrow = narrow
        yield swarm


def test_outputs_a_float16_server_cannot_hold_are_routed_around_and_ban_nobody(swarm, model_path):
    expected = hf_greedy(model_path, PROMPT, NEW_TOKENS)
    output, banned, avoided = greedy_through(swarm, model_path, PROMPT, NEW_TOKENS)
    assert output.tolist() == expected.tolist()
    assert not banned  # before: the float16 server, for refusing inputs past its range
    assert swarm.narrow.peer_id in avoided  # the route went through it, and the client went around it


def test_a_forward_pass_past_a_float16_servers_range_is_routed_around_and_bans_nobody(swarm, model_path):
    """The same through `rpc_forward` (the model's forward: `remote_sequential`), a client of its own."""
    with AutoDistributedModelForCausalLM.from_pretrained(
        model_path, initial_peers=swarm.initial_peers, client_config=FAST_CLIENT
    ) as model:
        model.manager.wait_ready()
        with torch.no_grad():
            expected = hf_model(model_path)(PROMPT).logits
            for _ in range(16):  # a forward's route picks a server of 2:4 at random: until it picked the float16 one
                torch.testing.assert_close(model(PROMPT).logits, expected, atol=1e-3, rtol=0)
                banned, avoided = model.manager.bans.banned_peers(), model.manager.avoided_peers()
                if banned or avoided:
                    break
    assert not banned  # before: the float16 server, for refusing inputs past its range
    assert swarm.narrow.peer_id in avoided  # the route went through it, and the client went around it
