"""Qwen3, Qwen3-MoE, Phi-3 and DeepSeek-V3 served end to end: one loopback swarm, a server per family (DeepSeek-V3:
two holding the same blocks); greedy tokens through corolla's client equal local transformers, one chat request per
family through corolla-api (tokenizer chat template) equals local greedy, and DeepSeek-V3's server SIGKILLed
mid-generation is replaced by its replica with identical output (its replayed cache is the MLA latent)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer

import helpers.tiny_models_fam_a as fam_a
from corolla.client import AutoDistributedModelForCausalLM, ClientConfig
from helpers.family_swarm import KillAt, chat_through_api, local_argmax_tokens, local_greedy, served_families

pytestmark = pytest.mark.timeout(600)

FAMILIES = fam_a.FAM_A_FAMILIES
FAILOVER_FAMILIES = ("deepseek_v3",)  # served twice: the kill-and-replay check
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
    # generous timeouts: a loaded 2-core CI machine
    with served_families(
        tmp_path_factory,
        FAMILIES,
        CHAT_TEMPLATE,
        replicated=FAILOVER_FAMILIES,
        bootstrap_timeout_s=180,
        ready_timeout_s=500,
    ) as swarm_and_paths:
        yield swarm_and_paths


@pytest.mark.parametrize("family", FAMILIES)
def test_family_served_end_to_end(served, family):
    """One client per family (client start-up is most of the cost): greedy through the client, one chat request
    through corolla-api, then (FAILOVER_FAMILIES) greedy again with the session's first server SIGKILLed
    mid-generation."""
    swarm, paths = served
    expected = local_greedy(paths[family], PROMPT, NEW_TOKENS)
    tokenizer = AutoTokenizer.from_pretrained(paths[family])
    messages = [{"role": "user", "content": "Hi swarm"}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text.endswith("<|im_start|>assistant\n")  # the tokenizer's own template was applied
    chat_ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
    expected_chat = tokenizer.decode(local_argmax_tokens(paths[family], chat_ids, 8), skip_special_tokens=True)

    with AutoDistributedModelForCausalLM.from_pretrained(
        paths[family], initial_peers=swarm.initial_peers, client_config=CLIENT
    ) as model:
        out = model.generate(PROMPT, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
        assert out[0].tolist() == expected

        reply = chat_through_api(model, tokenizer, family, messages)
        assert reply["choices"][0]["message"]["content"] == expected_chat
        assert reply["usage"]["prompt_tokens"] == chat_ids.shape[1]
        if family not in FAILOVER_FAMILIES:
            return

        streamer = KillAt(swarm, at=NEW_TOKENS // 2)
        with model.inference_session(max_length=PROMPT.shape[1] + NEW_TOKENS) as session:
            streamer.session = session
            out = model.generate(
                PROMPT, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, session=session, streamer=streamer
            )
    assert streamer.killed and streamer.killed[0].wait(10) is not None
    assert out[0].tolist() == expected
