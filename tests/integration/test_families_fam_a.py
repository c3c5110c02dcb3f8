"""Qwen3, Qwen3-MoE, Phi-3 and DeepSeek-V3 served end to end: one loopback swarm, two servers per family holding
the same blocks; greedy tokens through corolla's client equal local transformers, one chat request per family
through corolla-api (tokenizer chat template) equals local greedy, and a server SIGKILLed mid-generation is
replaced by its replica with identical output (for DeepSeek-V3 the replayed cache is the MLA latent)."""

from __future__ import annotations

import json
import signal
import urllib.request

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import helpers.tiny_models_fam_a as fam_a
from corolla.api.app import create_app
from corolla.api.backend import SwarmBackend
from corolla.api.serving import serve_in_thread
from corolla.client import AutoDistributedModelForCausalLM, ClientConfig
from helpers.swarm import Swarm
from helpers.tiny_models import make_tiny_model

pytestmark = pytest.mark.timeout(600)

FAMILIES = fam_a.FAM_A_FAMILIES
PROMPT = torch.tensor([[1, 8, 27, 64, 125, 33]])
NEW_TOKENS = 16
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# max_retries 8 (about 25 s of backoff): on a loaded 2-core machine a server's DHT record can lapse for a moment
CLIENT = ClientConfig(
    max_retries=8, min_backoff_s=0.2, max_backoff_s=8.0, update_period_s=2.0, liveness_check_period_s=1.0
)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory):
    models_dir = tmp_path_factory.mktemp("models")
    paths = {family: make_tiny_model(family, models_dir, num_layers=2) for family in FAMILIES}
    for path in paths.values():  # a chat template, as the real tokenizers of these families carry
        tokenizer = AutoTokenizer.from_pretrained(path)
        tokenizer.chat_template = CHAT_TEMPLATE
        tokenizer.save_pretrained(path)
    swarm = Swarm(tmp_path_factory.mktemp("swarm"))
    try:
        swarm.start_bootstrap(timeout_s=180)  # generous: a loaded 2-core CI machine
        servers = [
            swarm.start_server(path, "--block_indices", "0:2", "--throughput", "1.0", wait=False)
            for path in paths.values()
            for _ in range(2)
        ]
        for server in servers:
            server.wait_ready(500)
        yield swarm, paths
    finally:
        swarm.close()


def _local_argmax_tokens(path, ids: torch.Tensor, new_tokens: int) -> list[int]:
    """What `ignore_eos` greedy decoding gives: the argmax even when it is EOS (unlike `min_new_tokens`, which bans
    EOS and so picks the runner-up)."""
    local = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    seq = ids
    with torch.no_grad():
        for _ in range(new_tokens):
            next_id = local(seq).logits[:, -1].argmax(dim=-1, keepdim=True)  # [1, 1]
            seq = torch.cat([seq, next_id], dim=1)
    return seq[0, ids.shape[1] :].tolist()


def _local_greedy(path, ids: torch.Tensor, new_tokens: int) -> list[int]:
    local = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        out = local.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    return out[0].tolist()


def _chat_through_api(model, tokenizer, family: str, messages: list[dict[str, str]]) -> dict:
    backend = SwarmBackend(model, tokenizer, model_id=family)
    with serve_in_thread(create_app(backend)) as running:
        body = {"model": family, "messages": messages, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        request = urllib.request.Request(
            f"http://127.0.0.1:{running.port}/v1/chat/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=60) as response:
            return json.loads(response.read())


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
def test_family_served_end_to_end(served, family):
    """One client per family (client start-up is most of the cost): greedy through the client, one chat request
    through corolla-api, then greedy again with the session's first server SIGKILLed mid-generation."""
    swarm, paths = served
    expected = _local_greedy(paths[family], PROMPT, NEW_TOKENS)
    tokenizer = AutoTokenizer.from_pretrained(paths[family])
    messages = [{"role": "user", "content": "Hi swarm"}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text.endswith("<|im_start|>assistant\n")  # the tokenizer's own template was applied
    chat_ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
    expected_chat = tokenizer.decode(_local_argmax_tokens(paths[family], chat_ids, 8), skip_special_tokens=True)

    with AutoDistributedModelForCausalLM.from_pretrained(
        paths[family], initial_peers=swarm.initial_peers, client_config=CLIENT
    ) as model:
        out = model.generate(PROMPT, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
        assert out[0].tolist() == expected

        reply = _chat_through_api(model, tokenizer, family, messages)
        assert reply["choices"][0]["message"]["content"] == expected_chat
        assert reply["usage"]["prompt_tokens"] == chat_ids.shape[1]

        streamer = KillAt(swarm, at=NEW_TOKENS // 2)
        with model.inference_session(max_length=PROMPT.shape[1] + NEW_TOKENS) as session:
            streamer.session = session
            out = model.generate(
                PROMPT, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, session=session, streamer=streamer
            )
    assert streamer.killed and streamer.killed[0].wait(10) is not None
    assert out[0].tolist() == expected
