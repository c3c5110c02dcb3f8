"""Gemma 2, Gemma 3 (text) and gpt-oss served end to end: one loopback swarm, two servers per family holding the
same blocks; greedy tokens through corolla's client equal local transformers (72 new tokens, so the sliding
layers' ring caches wrap), one chat request per family through corolla-api (tokenizer chat template) equals local
greedy, and a server SIGKILLed mid-generation is replaced by its replica with identical output."""

from __future__ import annotations

import json
import signal
import urllib.request

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import helpers.tiny_models_fam_b as fam_b
from corolla.api.app import create_app
from corolla.api.backend import SwarmBackend
from corolla.api.serving import serve_in_thread
from corolla.client import AutoDistributedModelForCausalLM, ClientConfig
from helpers.swarm import Swarm
from helpers.tiny_models import make_tiny_model

pytestmark = pytest.mark.timeout(240)

FAMILIES = fam_b.FAM_B_FAMILIES
PROMPT = torch.tensor([[1, 8, 27, 64, 125, 33]])
NEW_TOKENS = 72  # 78 positions > the ring of a tiny sliding layer (window 6 + slack 64)
FAILOVER_TOKENS, KILL_AT = 24, 8
CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant\n{% endif %}"
)
CLIENT = ClientConfig(max_retries=5, min_backoff_s=0.2, update_period_s=2.0, liveness_check_period_s=1.0)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory):
    models_dir = tmp_path_factory.mktemp("models")
    paths = {family: make_tiny_model(family, models_dir, num_layers=2) for family in FAMILIES}
    for path in paths.values():  # a chat template, as real Gemma / gpt-oss tokenizers carry
        tokenizer = AutoTokenizer.from_pretrained(path)
        tokenizer.chat_template = CHAT_TEMPLATE
        tokenizer.save_pretrained(path)
    swarm = Swarm(tmp_path_factory.mktemp("swarm"))
    try:
        swarm.start_bootstrap()
        servers = [
            swarm.start_server(path, "--block_indices", "0:2", "--throughput", "1.0", wait=False)
            for path in paths.values()
            for _ in range(2)
        ]
        for server in servers:
            server.wait_ready(120)
        yield swarm, paths
    finally:
        swarm.close()


def _local_greedy(path, ids: torch.Tensor, new_tokens: int) -> list[int]:
    local = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        out = local.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    return out[0].tolist()


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_matches_local(served, family):
    swarm, paths = served
    with AutoDistributedModelForCausalLM.from_pretrained(
        paths[family], initial_peers=swarm.initial_peers, client_config=CLIENT
    ) as model:
        out = model.generate(PROMPT, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
    assert out[0].tolist() == _local_greedy(paths[family], PROMPT, NEW_TOKENS)


@pytest.mark.parametrize("family", FAMILIES)
def test_chat_through_corolla_api_matches_local(served, family):
    swarm, paths = served
    tokenizer = AutoTokenizer.from_pretrained(paths[family])
    messages = [{"role": "user", "content": "Hi swarm"}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
    expected_ids = _local_greedy(paths[family], ids, 8)[ids.shape[1] :]
    expected = tokenizer.decode(expected_ids, skip_special_tokens=True)
    with AutoDistributedModelForCausalLM.from_pretrained(
        paths[family], initial_peers=swarm.initial_peers, client_config=CLIENT
    ) as model:
        backend = SwarmBackend(model, tokenizer, model_id=family)
        with serve_in_thread(create_app(backend)) as running:
            body = {"model": family, "messages": messages, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
            request = urllib.request.Request(
                f"http://127.0.0.1:{running.port}/v1/chat/completions",
                data=json.dumps(body).encode(),
                headers={"Content-Type": "application/json"},
            )
            with urllib.request.urlopen(request, timeout=60) as response:
                reply = json.loads(response.read())
    assert reply["choices"][0]["message"]["content"] == expected
    assert reply["usage"]["prompt_tokens"] == ids.shape[1]


class KillAt:
    """A streamer that SIGKILLs the server of the session's first span at generated token `at`."""

    def __init__(self, swarm: Swarm, at: int):
        self.swarm, self.at, self.count, self.session, self.killed = swarm, at, 0, None, []

    def put(self, value):
        self.count += 1
        if self.count == self.at + 1:  # the first put is the prompt
            peer_id = self.session._spans[0].span.peer_id
            victim = next(p for p in self.swarm.processes if getattr(p, "peer_id", None) == peer_id)
            victim.signal(signal.SIGKILL)
            self.killed.append(victim)

    def end(self):
        pass


@pytest.mark.parametrize("family", FAMILIES)
def test_sigkill_mid_generation_fails_over_to_the_replica(served, family):
    swarm, paths = served
    streamer = KillAt(swarm, at=KILL_AT)
    with AutoDistributedModelForCausalLM.from_pretrained(
        paths[family], initial_peers=swarm.initial_peers, client_config=CLIENT
    ) as model:
        with model.inference_session(max_length=PROMPT.shape[1] + FAILOVER_TOKENS) as session:
            streamer.session = session
            out = model.generate(
                PROMPT, max_new_tokens=FAILOVER_TOKENS, min_new_tokens=FAILOVER_TOKENS, session=session,
                streamer=streamer,
            )  # fmt: skip
    assert streamer.killed and streamer.killed[0].wait(10) is not None
    assert out[0].tolist() == _local_greedy(paths[family], PROMPT, FAILOVER_TOKENS)
