"""Prefix caching through real servers, the client and corolla-api on every family the servers serve (issue 34's
target), each on the path its server picks (fused or eager): the next turn of a conversation reuses the servers'
cached prefix and its greedy tokens equal local `transformers`, whose tokens the family tests show the client gives
without reuse (test_families_fam_a/b, test_client_families, test_client_generation: prompts shorter than a 16-token
block reuse nothing); after the cache was evicted between turns the turn reuses nothing and still gives the same
tokens. Through corolla-api, a chat's second turn reports its reused prompt tokens (`cached_tokens`) and answers as
local `transformers` and as the same request with the client's reuse off. One family (CHAIN_FAMILY) is served by a
chain of two servers: the client probes both, reuses the shorter hit, after one of them evicted reuses nothing, and
when the second leaves mid-answer after a hit, the chain restarts from position 0 on its replacement (which never
had the inputs of the reused positions) with the same tokens; the chain, the probe and the API are the same code for
every family. The servers run in this process (what they serve is under test)."""

from __future__ import annotations

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
from helpers.api_client import openai_client
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
# drain_timeout_s=0: a server that stops ends its sessions at once, as one that leaves (no hand-off of their KV)
SERVER = dict(inference_max_length_tokens=256, attn_cache_tokens=2048, drain_timeout_s=0.0)


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


def metric(server, name: str) -> float:
    for line in server.metrics.render().decode().splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"no {name}")


def hit_tokens(server) -> float:
    return metric(server, "corolla_prefix_hit_tokens_total")


def evict_everything(server) -> None:
    """What many other sessions would do between two turns: promise every page, evicting the idle cached ones."""
    pool = server.service.executor.engine.pool
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


class StopAt:
    """A streamer that stops the server of `session`'s span `index` (its sessions end) at generated token `at`."""

    def __init__(self, servers, session, index: int, at: int):
        self.servers, self.session, self.index, self.at, self.count = servers, session, index, at, 0
        self.stopped: list[str] = []

    def put(self, value: torch.Tensor) -> None:
        self.count += 1
        if self.count == self.at + 1:  # the first put is the prompt
            peer_id = self.session.route[self.index][0].peer_id
            next(server for server in self.servers if server.peer_id == peer_id).shutdown()
            self.stopped.append(peer_id)

    def end(self) -> None:
        pass


def a_server_leaves_mid_answer(model, path, servers, cache_dir, prompt: torch.Tensor, expected: list[int]) -> None:
    """`prompt` was computed by the chain's last turn: a replacement for the second span joins, the next turn reuses
    the prefix on the chain that held it, and its second server stops at the 4th generated token."""
    with inprocess_servers([(path, "1:2")], cache_dir, servers[0].join_maddrs, **SERVER) as replacement:
        model.manager.update()  # the client sees the replacement
        opened = metric(servers[0], "corolla_sessions_opened_total")
        with model.inference_session(max_length=prompt.shape[1] + NEW_TOKENS) as session:
            streamer = StopAt([*servers, *replacement], session, index=1, at=4)
            out = model.generate(
                prompt, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False, session=session,
                streamer=streamer,
            )  # fmt: skip
            assert session.reused_tokens == 32 and streamer.stopped  # 46 prompt positions: two whole pages
            assert session.num_restarts == 1 and session.route[1][0].peer_id not in streamer.stopped
        assert out[0].tolist() == expected
        # the first server answered the restart (a new step from position 0) in its session: no reply of the step
        # it had answered before (a wrong shape), no ban, no second session
        assert metric(servers[0], "corolla_sessions_opened_total") == opened + 1


def test_chat_completions_reuse_the_conversation_with_the_same_tokens(served, model) -> None:
    """Two turns of a chat through corolla-api (the gateway's own session per request, `ignore_eos` greedy): the
    second reuses the first's prompt and answers as local transformers and as the gateway with reuse off."""
    family, path, servers = served
    way = f"{family} ({servers[0].service.executor.path}, {len(servers)} server(s))"
    backend = SwarmBackend(model, AutoTokenizer.from_pretrained(path), model_id=family)

    def expected(messages: list[dict[str, str]]) -> str:
        ids = torch.tensor([backend.chat_prompt_ids(messages)])  # [1, T]
        return backend.decode(local_argmax_tokens(path, ids, NEW_TOKENS))

    body = {"model": family, "max_tokens": NEW_TOKENS, "temperature": 0, "extra_body": {"ignore_eos": True}}
    with serve_in_thread(create_app(backend)) as running:
        client = openai_client(running.url, timeout_s=60)
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


def test_the_next_turn_reuses_the_cached_prefix_with_the_same_tokens(served, model, tmp_path) -> None:
    family, path, servers = served
    way = f"{family} ({servers[0].service.executor.path}, {len(servers)} server(s))"
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
    if len(servers) > 1:  # the chain family, last: its second server is gone afterwards
        a_server_leaves_mid_answer(model, path, servers, tmp_path, second_prompt, expected_second)
