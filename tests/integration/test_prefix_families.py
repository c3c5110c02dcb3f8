"""Prefix caching end to end on a chain of two servers: the next turn of a conversation reuses its prefix on every
server of the chain, and the greedy tokens equal local transformers and the client without reuse, through the client
and through corolla-api (whose usage reports the cached tokens). One family: the chain, the probe and the API are the
same code for every family; every family's server is checked in test_prefix_cache_families and every family's engine
in tests/unit/test_prefix_greedy_families.py. The servers run in this process (what they serve is under test)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer

from corolla.api.app import create_app
from corolla.api.backend import SwarmBackend
from corolla.api.serving import serve_in_thread
from corolla.client import AutoDistributedModelForCausalLM, ClientConfig
from helpers.family_swarm import local_greedy
from helpers.swarm import inprocess_servers, start_inprocess_server
from helpers.tiny_models import make_tiny_model

pytestmark = pytest.mark.timeout(600)

FAMILY = "llama"
NEW_TOKENS = 12
CLIENT = ClientConfig(max_retries=8, min_backoff_s=0.2, max_backoff_s=8.0, update_period_s=2.0)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(the chain's initial peers, the model's path): blocks 0:1 and 1:2 on two servers."""
    path = make_tiny_model(FAMILY, tmp_path_factory.mktemp("models"), num_layers=2)
    cache_dir = tmp_path_factory.mktemp("cache")
    first = start_inprocess_server(path, cache_dir, block_indices=(0, 1), throughput=1.0)
    try:
        with inprocess_servers([(path, "1:2")], cache_dir, first.join_maddrs):
            yield first.join_maddrs, path
    finally:
        first.shutdown()


def _generate(model, ids: torch.Tensor) -> tuple[list[int], int]:
    """Greedy in a fresh session: (prompt + new ids, positions reused from the servers' caches)."""
    with model.inference_session(max_length=ids.shape[1] + NEW_TOKENS) as session:
        out = model.generate(
            ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False, session=session
        )
        return out[0].tolist(), session.reused_tokens


def test_next_turn_reuses_the_prefix_with_the_same_tokens(served):
    initial_peers, path = served
    family = FAMILY
    torch.manual_seed(0)
    first = torch.randint(3, 200, (1, 40))
    with AutoDistributedModelForCausalLM.from_pretrained(
        path, initial_peers=initial_peers, client_config=CLIENT
    ) as model:
        out1, reused1 = _generate(model, first)
        assert out1 == local_greedy(path, first, NEW_TOKENS) and reused1 == 0
        second = torch.tensor([out1 + torch.randint(3, 200, (20,)).tolist()])  # the conversation goes on
        expected = local_greedy(path, second, NEW_TOKENS)
        out2, reused2 = _generate(model, second)
        assert reused2 == 48  # 40 + 12 generated (the last one never sent): whole blocks of 51 known positions
        assert out2 == expected
        model.manager.config.prefix_reuse = False
        assert _generate(model, second) == (expected, 0)
        model.manager.config.prefix_reuse = True

        tokenizer = AutoTokenizer.from_pretrained(path)
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
