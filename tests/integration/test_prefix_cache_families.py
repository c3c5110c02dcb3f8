"""Prefix caching through a real server and the client on every family the servers serve (issue 34's target), each
on the path its server picks (fused or eager): the next turn of a conversation reuses the server's cached prefix and
its greedy tokens equal local `transformers`, whose tokens the family tests show the client gives without reuse
(test_families_fam_a/b, test_client_families, test_client_generation: prompts shorter than a 16-token block reuse
nothing); after the cache was evicted between turns the turn reuses nothing and still gives the same tokens. The
two-server chain and corolla-api: test_prefix_families."""

from __future__ import annotations

import pytest
import torch

import helpers.tiny_models_fam_a as fam_a  # registers qwen3, qwen3_moe, phi3, deepseek_v3
import helpers.tiny_models_fam_b as fam_b  # registers gemma2, gemma3_text, gpt_oss
from corolla.client import AutoDistributedModelForCausalLM, ClientConfig
from corolla.models.registry import SUPPORTED_MODEL_TYPES
from helpers.family_swarm import local_greedy
from helpers.swarm import start_inprocess_server
from helpers.tiny_models import make_tiny_model

pytestmark = pytest.mark.timeout(300)

TURN1 = torch.tensor([[1, 17, 42, 99, 7, 250, 31, 8, 64, 3, 77, 5, 120, 44, 9, 61, 13, 200, 2 + 1, 90]])
FOLLOW_UP = torch.tensor([[33, 12, 140, 56, 71, 18, 240, 6, 15, 88, 99, 101, 47, 29]])
NEW_TOKENS = 12


@pytest.fixture(scope="module", params=SUPPORTED_MODEL_TYPES)
def served(request, tmp_path_factory: pytest.TempPathFactory):
    family = request.param
    assert fam_a is not None and fam_b is not None
    path = make_tiny_model(family, tmp_path_factory.mktemp("models"), num_layers=2)
    server = start_inprocess_server(
        path, tmp_path_factory.mktemp("cache"), block_indices=(0, 2), inference_max_length_tokens=256,
        attn_cache_tokens=2048,
    )  # fmt: skip
    try:
        yield family, path, server
    finally:
        server.shutdown()


def hit_tokens(server) -> float:
    for line in server.metrics.render().decode().splitlines():
        if line.startswith("corolla_prefix_hit_tokens_total "):
            return float(line.split()[1])
    raise AssertionError("no corolla_prefix_hit_tokens_total")


def evict_everything(server) -> None:
    """What many other sessions would do between two turns: promise every page, evicting the idle cached ones."""
    pool = server.service.handler.executor.engine.pool
    slots = pool.allocate(pool.pages_free, pool.page_size_tokens)
    pool.free(slots)
    assert pool.layer_pages_cached == 0


def conversation(model) -> tuple[list[int], list[int]]:
    """Two greedy turns, the second continuing the first's conversation."""
    first = model.generate(TURN1, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
    second_prompt = torch.cat([first, FOLLOW_UP], dim=1)
    second = model.generate(second_prompt, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
    return first[0].tolist(), second[0].tolist()


def test_the_next_turn_reuses_the_cached_prefix_with_the_same_tokens(served) -> None:
    family, path, server = served
    way = f"{family} ({server.service.handler.executor.path})"
    expected_first = local_greedy(path, TURN1, NEW_TOKENS)
    expected_second = local_greedy(path, torch.cat([torch.tensor([expected_first]), FOLLOW_UP], dim=1), NEW_TOKENS)
    config = ClientConfig(max_retries=2, min_backoff_s=0.2)
    with AutoDistributedModelForCausalLM.from_pretrained(
        path, initial_peers=server.join_maddrs, client_config=config
    ) as model:
        assert model.manager.config.prefix_reuse  # (the default)
        hits = hit_tokens(server)
        assert conversation(model) == (expected_first, expected_second), way
        # turn 1 computed 20 + 11 positions (its last token is never fed back): one whole 16-token page
        assert hit_tokens(server) - hits == 16, way

        evict_everything(server)  # the cache is gone before the next turn: it falls back to a full prefill
        hits = hit_tokens(server)
        second_prompt = torch.tensor([expected_first + FOLLOW_UP[0].tolist()])
        out = model.generate(second_prompt, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
        assert out[0].tolist() == expected_second and hit_tokens(server) == hits, way
