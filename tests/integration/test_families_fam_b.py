"""Gemma 2, Gemma 3 (text) and gpt-oss served end to end: one loopback swarm, a server per family (gpt-oss: two
holding the same blocks); greedy tokens through corolla's client equal local transformers (72 new tokens, so the
sliding layers' ring caches wrap), one chat request per family through corolla-api (tokenizer chat template) equals
local greedy, and gpt-oss's server SIGKILLed mid-generation is replaced by its replica with identical output (one
client per family for all three)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer

import helpers.tiny_models_fam_b as fam_b
from corolla.client import AutoDistributedModelForCausalLM, ClientConfig
from helpers.family_swarm import KillAt, chat_through_api, local_greedy, served_families

pytestmark = pytest.mark.timeout(600)

FAMILIES = fam_b.FAM_B_FAMILIES
FAILOVER_FAMILIES = ("gpt_oss",)  # served twice: the kill-and-replay check (sliding layers, sinks and experts)
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
    with served_families(tmp_path_factory, FAMILIES, CHAT_TEMPLATE, replicated=FAILOVER_FAMILIES) as swarm_and_paths:
        yield swarm_and_paths


@pytest.mark.parametrize("family", FAMILIES)
def test_family_served_end_to_end(served, family):
    """One client per family (client start-up is most of the cost): greedy through the client equals local
    transformers, one chat request through corolla-api equals local greedy, then (FAILOVER_FAMILIES) greedy with the
    session's first server SIGKILLed mid-generation equals local greedy (the replica took over)."""
    swarm, paths = served
    tokenizer = AutoTokenizer.from_pretrained(paths[family])
    messages = [{"role": "user", "content": "Hi swarm"}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    chat_ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
    expected_chat = tokenizer.decode(
        local_greedy(paths[family], chat_ids, 8)[chat_ids.shape[1] :], skip_special_tokens=True
    )
    streamer = KillAt(swarm, at=KILL_AT)
    with AutoDistributedModelForCausalLM.from_pretrained(
        paths[family], initial_peers=swarm.initial_peers, client_config=CLIENT
    ) as model:
        out = model.generate(PROMPT, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
        assert out[0].tolist() == local_greedy(paths[family], PROMPT, NEW_TOKENS)

        reply = chat_through_api(model, tokenizer, family, messages)
        assert reply["choices"][0]["message"]["content"] == expected_chat
        assert reply["usage"]["prompt_tokens"] == chat_ids.shape[1]
        if family not in FAILOVER_FAMILIES:
            return

        with model.inference_session(max_length=PROMPT.shape[1] + FAILOVER_TOKENS) as session:
            streamer.session = session
            out = model.generate(
                PROMPT, max_new_tokens=FAILOVER_TOKENS, min_new_tokens=FAILOVER_TOKENS, session=session,
                streamer=streamer,
            )  # fmt: skip
    assert streamer.killed and streamer.killed[0].wait(10) is not None
    assert out[0].tolist() == local_greedy(paths[family], PROMPT, FAILOVER_TOKENS)
