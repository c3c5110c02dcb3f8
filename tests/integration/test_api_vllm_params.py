"""Every OpenAI / vLLM sampling parameter of corolla-api has its effect (or is refused with a 400 naming it), over
in-process backends whose logits are known, driven by the official `openai` client; the service routes (`/health`,
`/version`, `/tokenize`, `/detokenize`, `/metrics`) and generation_config.json defaults. The swarm versions of the
logprobs, tokenize and defaults checks are in test_api_swarm."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator

import openai
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from test_api_app import EOS, MODEL, SCRIPT, VOCAB, ScriptedBackend, post_raw, script_text

import corolla
from corolla.api.app import ApiConfig, create_app
from corolla.api.backend import SwarmBackend, generation_defaults
from corolla.api.sampling import Sampler, SamplingParams
from corolla.api.serving import serve_in_thread
from helpers.api_client import openai_client

pytestmark = pytest.mark.timeout(60)


class RepeatingBackend(ScriptedBackend):
    """Fixed logits whatever the history: greedy repeats token 1 ("Hel") forever, token 2 ("lo") is a close second,
    so penalties visibly change what greedy picks."""

    FIXED = torch.tensor([-5.0, 3.0, 2.5, 1.0, 0.5, 0.0, -1.0, -1.0, -1.0, -1.0, -1.0])

    def step_logits(self, prompt_ids: list[int], max_length: int) -> Iterator[torch.Tensor]:
        for _ in range(max_length - len(prompt_ids)):
            yield self.FIXED.clone()


@pytest.fixture(scope="module")
def backend():
    return ScriptedBackend()


@pytest.fixture(scope="module")
def api(backend):
    with serve_in_thread(create_app(backend, ApiConfig(max_n=4, max_logprobs=5))) as running:
        yield running


@pytest.fixture(scope="module")
def client(api):
    return openai_client(api.url)


@pytest.fixture(scope="module")
def repeating():
    with serve_in_thread(create_app(RepeatingBackend())) as running:
        yield openai_client(running.url)


def complete(client: openai.OpenAI, **kwargs) -> openai.types.Completion:
    vllm = {k: kwargs.pop(k) for k in list(kwargs) if k in VLLM_FIELDS}
    kwargs.setdefault("temperature", 0)
    return client.completions.create(model=MODEL, prompt="p", extra_body=vllm or None, **kwargs)


VLLM_FIELDS = {
    "top_k",
    "min_p",
    "repetition_penalty",
    "min_tokens",
    "ignore_eos",
    "stop_token_ids",
    "allowed_token_ids",
}


def test_min_tokens_suppresses_eos(client):
    plain = complete(client, max_tokens=40)
    assert plain.usage.completion_tokens == len(SCRIPT) + 1 and plain.choices[0].finish_reason == "stop"
    longer = complete(client, max_tokens=40, min_tokens=len(SCRIPT) + 4)
    assert longer.usage.completion_tokens >= len(SCRIPT) + 4
    assert longer.choices[0].text.startswith(script_text(len(SCRIPT)))


def test_ignore_eos_runs_to_max_tokens(client):
    out = complete(client, max_tokens=len(SCRIPT) + 6, ignore_eos=True)
    assert out.usage.completion_tokens == len(SCRIPT) + 6 and out.choices[0].finish_reason == "length"


def test_stop_token_ids_stop(client, backend):
    out = complete(client, max_tokens=40, stop_token_ids=[SCRIPT[3]])
    assert out.choices[0].text == script_text(3)
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].model_extra["stop_reason"] == SCRIPT[3]
    assert out.usage.completion_tokens == 4  # the stop token was generated, its text not shown
    # min_tokens also masks stop_token_ids
    later = complete(client, max_tokens=40, stop_token_ids=[SCRIPT[3]], min_tokens=6)
    assert later.usage.completion_tokens >= 6 and later.choices[0].text.startswith(script_text(3))


def test_logit_bias_and_allowed_token_ids(client):
    out = complete(client, max_tokens=3, logit_bias={"5": 100})
    assert out.choices[0].text == VOCAB[5] * 3
    out = complete(client, max_tokens=3, allowed_token_ids=[7, 8])
    assert set(out.choices[0].text.replace(VOCAB[7], "").replace(VOCAB[8], "")) == set()


def test_presence_and_frequency_penalties_as_openai_defines(repeating):
    greedy = repeating.completions.create(model=MODEL, prompt="p", max_tokens=4, temperature=0)
    assert greedy.choices[0].text == VOCAB[1] * 4  # without penalties greedy repeats token 1
    # presence 1.0: after one "Hel", token 1 scores 3.0 - 1.0 = 2.0 < 2.5 (token 2); then both are penalized once
    out = repeating.completions.create(model=MODEL, prompt="p", max_tokens=4, temperature=0, presence_penalty=1.0)
    assert out.choices[0].text == "Hel" + "lo" + "Hel" + "Hel"  # presence counts once, however often
    # frequency 0.3: token 1 after k uses scores 3.0 - 0.3k; token 2 overtakes once 3 - 0.3k < 2.5 - 0.3j
    out = repeating.completions.create(model=MODEL, prompt="p", max_tokens=5, temperature=0, frequency_penalty=0.3)
    assert out.choices[0].text == "Hel" + "Hel" + "lo" + "Hel" + "lo"


def test_repetition_penalty_covers_the_prompt(repeating):
    # token ids as the prompt, so that token 1 ("Hel") is in it
    out = repeating.completions.create(
        model=MODEL, prompt=[1], max_tokens=1, temperature=0, extra_body={"repetition_penalty": 1.5}
    )
    assert out.choices[0].text == "lo"  # 3.0 / 1.5 = 2.0 < 2.5
    out = repeating.completions.create(model=MODEL, prompt=[9], max_tokens=1, temperature=0)
    assert out.choices[0].text == "Hel"


def test_sampler_penalties_match_the_definitions():
    logits = torch.tensor([1.0, -2.0, 0.5, 3.0])
    params = SamplingParams(
        max_new_tokens=8, presence_penalty=0.7, frequency_penalty=0.2, repetition_penalty=2.0, temperature=0
    )
    sampler = Sampler(params, prompt_ids=[1], end_token_ids=[0])
    for token in (3, 3, 2):
        forced = torch.full((4,), -50.0)
        forced[token] = 50.0
        assert sampler.choose(forced).token_id == token
    expected = torch.tensor(
        [
            1.0,  # never seen
            -2.0 * 2.0,  # prompt only: repetition penalty multiplies a negative logit, no presence/frequency
            0.5 / 2.0 - 0.2 * 1 - 0.7,
            3.0 / 2.0 - 0.2 * 2 - 0.7,
        ]
    )
    assert torch.allclose(sampler.process(logits), expected)


def test_top_k_and_min_p_truncate(client):
    # top_k=1 and min_p=1 keep only the argmax: sampling at temperature 2 then equals greedy
    greedy = complete(client, max_tokens=8).choices[0].text
    for extra in ({"top_k": 1}, {"min_p": 1.0}):
        for seed in (1, 2, 3):
            assert complete(client, max_tokens=8, temperature=2.0, seed=seed, **extra).choices[0].text == greedy
    sampled = {complete(client, max_tokens=8, temperature=2.0, seed=s).choices[0].text for s in (1, 2, 3)}
    assert len(sampled) > 1  # without truncation the same seeds differ


def test_n_choices_and_seed(client):
    def run(seed: int):
        out = client.completions.create(model=MODEL, prompt="s", max_tokens=8, temperature=1.0, n=3, seed=seed)
        assert [c.index for c in out.choices] == [0, 1, 2]
        return [c.text for c in out.choices]

    first = run(5)
    assert first == run(5)  # reproducible, choice by choice
    assert len(set(first)) > 1  # the choices are different samples
    assert first != run(6)

    chunks = list(
        client.completions.create(model=MODEL, prompt="s", max_tokens=8, temperature=1.0, n=3, seed=5, stream=True)
    )
    texts = ["".join(c.choices[0].text for c in chunks if c.choices[0].index == i) for i in range(3)]
    assert texts == first
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "q"}], max_tokens=4, temperature=0, n=2
    )
    assert [c.message.content for c in chat.choices] == [script_text(4)] * 2
    assert chat.usage.completion_tokens == 8


def test_logprobs_are_the_models_log_softmax(client, backend):
    prompt_ids = backend.encode("lp")
    out = client.completions.create(model=MODEL, prompt="lp", max_tokens=4, temperature=0, logprobs=3)
    lp = out.choices[0].logprobs
    assert lp.tokens == [VOCAB[t] for t in SCRIPT[:4]]
    for step, token in enumerate(SCRIPT[:4]):
        expected = torch.log_softmax(backend.logits_at(prompt_ids, step), dim=-1)
        assert lp.token_logprobs[step] == pytest.approx(float(expected[token]), abs=1e-5)
        top_ids = torch.topk(expected, 3).indices.tolist()
        assert set(lp.top_logprobs[step]) >= {backend.decode([t]) for t in top_ids if t != EOS}
    assert lp.text_offset == [0, 3, 5, 8]

    messages = [{"role": "user", "content": "q"}]
    chat = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=3, temperature=0, logprobs=True, top_logprobs=2
    )
    content = chat.choices[0].logprobs.content
    chat_prompt = backend.chat_prompt_ids(messages)
    for step, entry in enumerate(content):
        expected = torch.log_softmax(backend.logits_at(chat_prompt, step), dim=-1)
        assert entry.token == VOCAB[SCRIPT[step]] and entry.bytes == list(entry.token.encode())
        assert entry.logprob == pytest.approx(float(expected[SCRIPT[step]]), abs=1e-5)
        assert len(entry.top_logprobs) == 2 and entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)

    streamed = list(
        client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=3, temperature=0, logprobs=True, top_logprobs=2, stream=True
        )
    )
    tokens = [e.token for c in streamed if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert tokens == [e.token for e in content]

    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="x", max_tokens=1, logprobs=6)  # max_logprobs=5
    assert e.value.body["param"] == "logprobs"


@pytest.mark.parametrize(
    "field, value",
    [
        ("use_beam_search", True),
        ("best_of", 3),
        ("echo", True),
        ("suffix", "x"),
        ("prompt_logprobs", 1),
        ("guided_json", {"type": "object"}),
        ("include_stop_str_in_output", True),
        ("skip_special_tokens", False),
        ("truncate_prompt_tokens", 4),
        ("no_such_parameter", 1),
        ("n", 9),
        ("top_k", -2),
        ("repetition_penalty", 0),
        ("min_tokens", 50),
        ("stop_token_ids", [5_000_000]),
        ("logit_bias", {"abc": 1}),
        ("stream_options", {"include_usage": True, "continuous_usage_stats": True}),
    ],
)
def test_unsupported_or_bad_field_is_a_400_naming_it(api, field, value):
    body = {"model": MODEL, "prompt": "x", "max_tokens": 16, field: value}
    if field == "stream_options":
        body["stream"] = True
    status, raw = post_raw(api.url + "/v1/completions", json.dumps(body).encode())
    assert status == 400, raw
    error = json.loads(raw)["error"]
    assert error["param"] is not None and error["param"].split(".")[0] == field, error
    assert field in error["message"] or error["param"] == field


@pytest.mark.parametrize(
    "field, value",
    [
        ("tools", [{"type": "function", "function": {"name": "f"}}]),
        ("response_format", {"type": "json_object"}),
        ("top_logprobs", 2),  # without logprobs
        ("chat_template", "{{ messages }}"),
        ("add_generation_prompt", False),
        ("function_call", {"name": "f"}),
    ],
)
def test_chat_unsupported_field_is_a_400(api, field, value):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], field: value}
    status, raw = post_raw(api.url + "/v1/chat/completions", json.dumps(body).encode())
    assert status == 400, raw
    assert json.loads(raw)["error"]["param"] == field


def test_metadata_fields_accepted(client):
    out = client.completions.create(model=MODEL, prompt="p", max_tokens=2, temperature=0, user="u", seed=1)
    assert out.choices[0].text == script_text(2)


def test_generation_config_defaults_apply_when_unset():
    backend = ScriptedBackend()
    backend.generation_defaults = {"temperature": 0.0}  # greedy unless the request says otherwise
    with serve_in_thread(create_app(backend)) as running:
        client = openai_client(running.url)
        by_default = {
            client.completions.create(model=MODEL, prompt="s", max_tokens=8, seed=s).choices[0].text for s in (1, 2)
        }
        assert by_default == {script_text(8)}
        asked = {
            client.completions.create(model=MODEL, prompt="s", max_tokens=8, seed=s, temperature=1.0).choices[0].text
            for s in (1, 2, 3)
        }
        assert len(asked) > 1


def test_generation_defaults_and_eos_ids_from_generation_config():
    from types import SimpleNamespace

    from transformers import GenerationConfig

    from helpers.tiny_models import build_tokenizer

    config = GenerationConfig(temperature=0.6, top_k=20, top_p=0.9, repetition_penalty=1.1, eos_token_id=[2, 7])
    assert generation_defaults(config) == {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "repetition_penalty": 1.1}
    assert generation_defaults(GenerationConfig()) == {}
    model = SimpleNamespace(
        config=SimpleNamespace(max_position_embeddings=64, vocab_size=300), generation_config=config
    )
    backend = SwarmBackend(model, build_tokenizer(), model_id="m")
    assert {2, 7} <= backend.eos_token_ids
    assert backend.generation_defaults["top_k"] == 20


def get(url: str) -> tuple[int, bytes, str]:
    with urllib.request.urlopen(url, timeout=10) as response:
        return response.status, response.read(), response.headers.get("content-type", "")


def samples(text: str) -> dict[tuple[str, tuple], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_service_routes(api, client, backend):
    assert get(api.url + "/health")[0] == 200
    assert json.loads(get(api.url + "/version")[1]) == {"version": corolla.__version__}

    status, raw = post_raw(api.url + "/tokenize", json.dumps({"model": MODEL, "prompt": "hi"}).encode())
    assert status == 200
    body = json.loads(raw)
    assert body["tokens"] == backend.encode("hi") and body["count"] == 2 and body["max_model_len"] == 256
    messages = [{"role": "user", "content": "yo"}]
    status, raw = post_raw(api.url + "/tokenize", json.dumps({"messages": messages}).encode())
    assert json.loads(raw)["tokens"] == backend.chat_prompt_ids(messages)
    status, raw = post_raw(api.url + "/detokenize", json.dumps({"model": MODEL, "tokens": SCRIPT[:3]}).encode())
    assert (status, json.loads(raw)) == (200, {"prompt": script_text(3)})
    status, raw = post_raw(api.url + "/detokenize", json.dumps({"tokens": [-1]}).encode())
    assert status == 400 and json.loads(raw)["error"]["param"] == "tokens"
    status, raw = post_raw(api.url + "/tokenize", json.dumps({"model": "other", "prompt": "x"}).encode())
    assert status == 404

    before = samples(get(api.url + "/metrics")[1].decode())
    out = complete(client, max_tokens=5)
    with pytest.raises(openai.BadRequestError):
        complete(client, max_tokens=5, top_k=-7)
    status, text, content_type = get(api.url + "/metrics")
    assert content_type.startswith("text/plain")
    after = samples(text.decode())

    def delta(name: str, **labels: str) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert delta("corolla_api_requests_total", endpoint="/v1/completions", status="200") == 1
    assert delta("corolla_api_requests_total", endpoint="/v1/completions", status="400") == 1
    assert delta("corolla_api_generation_tokens_total") == out.usage.completion_tokens
    assert delta("corolla_api_prompt_tokens_total") == out.usage.prompt_tokens
    assert delta("corolla_api_time_to_first_token_seconds_count") == 1
    assert delta("corolla_api_inter_token_latency_seconds_count") == out.usage.completion_tokens - 1


def test_model_path_accepted_but_not_listed(backend):
    config = ApiConfig(unlisted_model_names=("/models/fake/scripted-model",))
    with serve_in_thread(create_app(backend, config)) as running:
        client = openai_client(running.url)
        assert [m.id for m in client.models.list().data] == [MODEL]
        out = client.completions.create(model="/models/fake/scripted-model", prompt="p", max_tokens=2, temperature=0)
        assert out.choices[0].text == script_text(2)


def test_default_model_id_is_the_directory_basename(tmp_path):
    from corolla.api.backend import default_model_id

    model_dir = tmp_path / "models" / "tiny-llama"
    model_dir.mkdir(parents=True)
    assert default_model_id(str(model_dir)) == "tiny-llama"
    assert default_model_id(str(model_dir) + "/") == "tiny-llama"
    assert default_model_id("meta-llama/Llama-3.1-8B-Instruct") == "meta-llama/Llama-3.1-8B-Instruct"  # a hub id


def test_a_response_message_sent_back_in_the_history(client, api):
    messages = [{"role": "user", "content": "q"}]
    first = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0)
    history = [*messages, first.choices[0].message, {"role": "user", "content": "more"}]  # refusal=None etc. included
    again = client.chat.completions.create(model=MODEL, messages=history, max_tokens=2, temperature=0)
    assert again.choices[0].message.content == script_text(2)
    tool_call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    body = {"model": MODEL, "messages": [{"role": "assistant", "content": None, "tool_calls": [tool_call]}]}
    status, raw = post_raw(api.url + "/v1/chat/completions", json.dumps(body).encode())
    assert status == 400 and "tool_calls" in json.loads(raw)["error"]["message"]
