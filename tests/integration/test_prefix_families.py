"""Prefix caching end to end on a two-server chain: the next turn of a conversation reuses its prefix on every
server of the chain, and the greedy tokens equal local transformers (hence equal with the cache off), through the
client and through corolla-api (whose usage reports the cached tokens). Two families (rotary, qk-norm): the chain,
the probe and the API do the same for every family; BLOOM and Gemma-2 run through a server in
test_prefix_cache_families and every family's engine in tests/unit/test_prefix_greedy_families.py."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer

import helpers.tiny_models_fam_a  # noqa: F401  (registers qwen3)
from corolla.api.app import create_app
from corolla.api.backend import SwarmBackend
from corolla.api.serving import serve_in_thread
from corolla.client import AutoDistributedModelForCausalLM, ClientConfig
from helpers.family_swarm import local_greedy
from helpers.swarm import Swarm
from helpers.tiny_models import make_tiny_model

pytestmark = pytest.mark.timeout(600)

FAMILIES = ("llama", "qwen3")
NEW_TOKENS = 12
CLIENT = ClientConfig(max_retries=8, min_backoff_s=0.2, max_backoff_s=8.0, update_period_s=2.0)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    models_dir = tmp_path_factory.mktemp("models")
    paths = {family: make_tiny_model(family, models_dir, num_layers=2) for family in FAMILIES}
    swarm = Swarm(tmp_path_factory.mktemp("swarm"))
    try:
        swarm.start_bootstrap(timeout_s=180)
        servers = [
            swarm.start_server(path, "--block_indices", blocks, "--throughput", "1.0", wait=False)
            for path in paths.values()
            for blocks in ("0:1", "1:2")
        ]
        for server in servers:
            server.wait_ready(500)
        yield swarm, paths
    finally:
        swarm.close()


def _generate(model, ids: torch.Tensor) -> tuple[list[int], int]:
    """Greedy in a fresh session: (prompt + new ids, positions reused from the servers' caches)."""
    with model.inference_session(max_length=ids.shape[1] + NEW_TOKENS) as session:
        out = model.generate(
            ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False, session=session
        )
        return out[0].tolist(), session.reused_tokens


@pytest.mark.parametrize("family", FAMILIES)
def test_next_turn_reuses_the_prefix_with_the_same_tokens(served, family):
    swarm, paths = served
    torch.manual_seed(0)
    first = torch.randint(3, 200, (1, 40))
    with AutoDistributedModelForCausalLM.from_pretrained(
        paths[family], initial_peers=swarm.initial_peers, client_config=CLIENT
    ) as model:
        out1, reused1 = _generate(model, first)
        assert out1 == local_greedy(paths[family], first, NEW_TOKENS) and reused1 == 0
        second = torch.tensor([out1 + torch.randint(3, 200, (20,)).tolist()])  # the conversation goes on
        expected = local_greedy(paths[family], second, NEW_TOKENS)
        out2, reused2 = _generate(model, second)
        assert reused2 == 48  # 40 + 12 generated (the last one never sent): whole blocks of 51 known positions
        assert out2 == expected
        model.manager.config.prefix_reuse = False
        assert _generate(model, second) == (expected, 0)
        model.manager.config.prefix_reuse = True

        tokenizer = AutoTokenizer.from_pretrained(paths[family])
        backend = SwarmBackend(model, tokenizer, model_id=family)
        with serve_in_thread(create_app(backend)) as running:
            import openai

            client = openai.OpenAI(base_url=running.url + "/v1", api_key="unused", max_retries=0, timeout=60)
            messages = [{"role": "user", "content": "The swarm keeps what it computed " * 3}]
            body = {"max_tokens": 8, "temperature": 0, "extra_body": {"ignore_eos": True}}
            reply = client.chat.completions.create(model=family, messages=messages, **body)
            messages += [{"role": "assistant", "content": reply.choices[0].message.content}]
            messages += [{"role": "user", "content": "and reuses it"}]
            reply2 = client.chat.completions.create(model=family, messages=messages, **body)
            assert reply2.usage.prompt_tokens_details.cached_tokens >= 96
            model.manager.config.prefix_reuse = False
            baseline = client.chat.completions.create(model=family, messages=messages, **body)
            assert baseline.usage.prompt_tokens_details.cached_tokens == 0
            assert reply2.choices[0].message.content == baseline.choices[0].message.content
