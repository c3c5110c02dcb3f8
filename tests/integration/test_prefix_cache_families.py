"""Prefix caching through real servers, the client and corolla-api on every family the servers serve (issue 34's
target), each on the path its server picks (fused or eager): the next turn of a conversation reuses the servers'
cached prefix and its greedy tokens equal local `transformers`, whose tokens the family tests show the client gives
without reuse (test_families_fam_a/b, test_client_families, test_client_generation: prompts shorter than a 16-token
block reuse nothing); after the cache was evicted between turns the turn reuses nothing and still gives the same
tokens. Through corolla-api, a chat's second turn reports its reused prompt tokens (`cached_tokens`) and answers as
local `transformers` and as the same request with the client's reuse off. One family (CHAIN_FAMILY) is served by a
chain of two servers: the client probes both, reuses the shorter hit, and after one of them evicted reuses nothing;
the chain, the probe and the API are the same code for every family. The servers run in this process (what they
serve is under test)."""

from __future__ import annotations

import openai
import pytest
import torch
from transformers import AutoTokenizer

import helpers.tiny_models_fam_a as fam_a  # registers qwen3, qwen3_moe, phi3, deepseek_v3
import helpers.tiny_models_fam_b as fam_b  # registers gemma2, gemma3_text, gpt_oss
from corolla.api.app import create_app
from corolla.api.backend import SwarmBackend
from corolla.api.serving import serve_in_thread
from corolla.client import AutoDistributedModelForCausalLM, ClientConfig
from corolla.models.registry import SUPPORTED_MODEL_TYPES
from corolla.protocol.prefix import PREFIX_BLOCK_TOKENS
from helpers.family_swarm import local_argmax_tokens, local_greedy
from helpers.swarm import inprocess_servers, start_inprocess_server
from helpers.tiny_models import make_tiny_model

pytestmark = pytest.mark.timeout(300)

CHAIN_FAMILY = "llama"  # served by two servers (blocks 0:1 and 1:2); every other family by one (0:2)
TURN1 = torch.tensor([[1, 17, 42, 99, 7, 250, 31, 8, 64, 3, 77, 5, 120, 44, 9, 61, 13, 200, 2 + 1, 90]])
FOLLOW_UP = torch.tensor([[33, 12, 140, 56, 71, 18, 240, 6, 15, 88, 99, 101, 47, 29]])
NEW_TOKENS = 12
CHAT = [{"role": "user", "content": "The swarm keeps what it computed for the next turn."}]
CHAT_FOLLOW_UP = {"role": "user", "content": "and reuses it"}
SERVER = dict(inference_max_length_tokens=256, attn_cache_tokens=2048)


@pytest.fixture(scope="module", params=SUPPORTED_MODEL_TYPES)
def served(request, tmp_path_factory: pytest.TempPathFactory):
    """(family, model path, its servers in chain order)."""
    family = request.param
    assert fam_a is not None and fam_b is not None
    path = make_tiny_model(family, tmp_path_factory.mktemp("models"), num_layers=2)
    cache_dir = tmp_path_factory.mktemp("cache")
    first = start_inprocess_server(path, cache_dir, block_indices=(0, 1 if family == CHAIN_FAMILY else 2), **SERVER)
    try:
        if family != CHAIN_FAMILY:
            yield family, path, [first]
            return
        with inprocess_servers([(path, "1:2")], cache_dir, first.join_maddrs, **SERVER) as rest:
            yield family, path, [first, *rest]
    finally:
        first.shutdown()


@pytest.fixture(scope="module")
def model(served):
    """The family's client (its start-up is most of a test's cost: one per family for both tests)."""
    _, path, servers = served
    config = ClientConfig(max_retries=4, min_backoff_s=0.2)
    with AutoDistributedModelForCausalLM.from_pretrained(
        path, initial_peers=servers[0].join_maddrs, client_config=config
    ) as model:
        yield model


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


def generate(model, ids: torch.Tensor) -> tuple[list[int], int]:
    """Greedy in a fresh session: (prompt + new ids, positions the chain reused from its servers' caches)."""
    with model.inference_session(max_length=ids.shape[1] + NEW_TOKENS) as session:
        out = model.generate(
            ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False, session=session
        )
        return out[0].tolist(), session.reused_tokens


def test_the_next_turn_reuses_the_cached_prefix_with_the_same_tokens(served, model) -> None:
    family, path, servers = served
    way = f"{family} ({servers[0].service.handler.executor.path}, {len(servers)} server(s))"
    expected_first = local_greedy(path, TURN1, NEW_TOKENS)
    second_prompt = torch.tensor([expected_first + FOLLOW_UP[0].tolist()])
    expected_second = local_greedy(path, second_prompt, NEW_TOKENS)
    assert model.manager.config.prefix_reuse  # (the default)
    hits = [hit_tokens(server) for server in servers]
    assert generate(model, TURN1) == (expected_first, 0), way
    # turn 1 computed 20 + 11 positions (its last token is never fed back): one whole 16-token page on every server
    assert generate(model, second_prompt) == (expected_second, 16), way
    assert [hit_tokens(server) - before for server, before in zip(servers, hits, strict=True)] == [16] * len(servers)

    # the cache is gone from the first server before the next turn (the chain's shortest hit is 0): a full prefill
    evict_everything(servers[0])
    hits = hit_tokens(servers[0])
    assert generate(model, second_prompt) == (expected_second, 0), way
    assert hit_tokens(servers[0]) == hits, way


def test_chat_completions_reuse_the_conversation_with_the_same_tokens(served, model) -> None:
    """Two turns of a chat through corolla-api (the gateway's own session per request, `ignore_eos` greedy): the
    second reuses the first's prompt and answers as local transformers and as the gateway with reuse off."""
    family, path, servers = served
    way = f"{family} ({servers[0].service.handler.executor.path}, {len(servers)} server(s))"
    backend = SwarmBackend(model, AutoTokenizer.from_pretrained(path), model_id=family)

    def expected(messages: list[dict[str, str]]) -> str:
        ids = torch.tensor([backend.chat_prompt_ids(messages)])  # [1, T]
        return backend.decode(local_argmax_tokens(path, ids, NEW_TOKENS))

    body = {"model": family, "max_tokens": NEW_TOKENS, "temperature": 0, "extra_body": {"ignore_eos": True}}
    with serve_in_thread(create_app(backend)) as running:
        client = openai.OpenAI(base_url=running.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        first = client.chat.completions.create(messages=CHAT, **body)
        assert first.usage.prompt_tokens_details.cached_tokens == 0, way
        assert first.choices[0].message.content == expected(CHAT), way
        messages = [*CHAT, {"role": "assistant", "content": first.choices[0].message.content}, CHAT_FOLLOW_UP]
        second = client.chat.completions.create(messages=messages, **body)
        # the first turn's prompt is the second's prefix (its answer, re-encoded, may differ from the tokens sampled)
        whole_blocks = len(backend.chat_prompt_ids(CHAT)) // PREFIX_BLOCK_TOKENS * PREFIX_BLOCK_TOKENS
        assert second.usage.prompt_tokens_details.cached_tokens >= whole_blocks > 0, way
        assert second.choices[0].message.content == expected(messages), way
        model.manager.config.prefix_reuse = False
        try:
            without = client.chat.completions.create(messages=messages, **body)
        finally:
            model.manager.config.prefix_reuse = True
        assert without.usage.prompt_tokens_details.cached_tokens == 0, way
        assert without.choices[0].message.content == second.choices[0].message.content, way
