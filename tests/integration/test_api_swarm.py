"""`corolla-api` (its CLI, as a process) over a loopback swarm of two servers (in this process) holding a tiny Llama, driven by the
official `openai` client: same tokens as local `transformers` greedy generation, stops, concurrency, errors."""

from __future__ import annotations

import json
import sys
import threading
import time
import urllib.error
import urllib.request

import openai
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from corolla.api.backend import plain_chat_prompt
from helpers.ports import free_port
from helpers.swarm import ManagedProcess, Swarm, bootstrapped, inprocess_servers
from helpers.tiny_models import make_tiny_model

pytestmark = pytest.mark.timeout(240)

MODEL_ID = "tiny-llama-chat"
PROMPT = "The swarm says"
API_BANNER = "corolla-api: serving "
GENERATION_DEFAULTS = {"do_sample": True, "temperature": 0.9, "top_k": 1}


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


class Gateway:
    def __init__(self, swarm: Swarm, model_path, servers):
        self.swarm, self.model_path, self.servers = swarm, model_path, servers
        self.tokenizer = __import__("transformers").AutoTokenizer.from_pretrained(model_path)
        self.reference = __import__("transformers").AutoModelForCausalLM.from_pretrained(model_path).eval()
        self.process = ManagedProcess(
            [
                sys.executable, "-m", "corolla.cli.api", "--model", str(model_path),
                "--initial_peers", *swarm.initial_peers, "--served_model_name", MODEL_ID,
                "--port", "0", "--max_retries", "2",
            ],
            name="corolla-api",
        )  # fmt: skip
        swarm.processes.append(self.process)
        line = self.process.wait_for_line(lambda s: s.startswith(API_BANNER), 90)
        self.base_url = line.rsplit(" at ", 1)[1].strip()  # http://127.0.0.1:PORT/v1
        self.client = openai.OpenAI(base_url=self.base_url, api_key="unused", max_retries=0, timeout=60)

    def greedy(self, prompt_ids: list[int], max_new_tokens: int) -> tuple[str, int]:
        """Local transformers greedy generation: (text of the new tokens, number of new tokens)."""
        with torch.no_grad():
            out = self.reference.generate(
                torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0
            )
        new = out[0, len(prompt_ids) :].tolist()
        return self.tokenizer.decode(new, skip_special_tokens=True), len(new)


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("api-swarm")
    model_path = make_tiny_model("llama", workdir / "models")
    # sampling defaults the gateway must apply when a request leaves them unset (greedy requests are unaffected)
    config = json.loads((model_path / "generation_config.json").read_text())
    config.update(GENERATION_DEFAULTS)
    (model_path / "generation_config.json").write_text(json.dumps(config))
    with bootstrapped(workdir) as swarm:
        # the servers run in this process (what they serve is under test, not their process: two interpreter
        # start-ups less); the gateway stays a process (its CLI is under test)
        spans = [(model_path, blocks, {"metrics_port": free_port()}) for blocks in ("0:2", "2:4")]
        with inprocess_servers(spans, workdir / "cache", swarm.initial_peers) as servers:
            yield Gateway(swarm, model_path, servers)


def prompt_ids(gateway: Gateway) -> list[int]:
    return gateway.tokenizer(PROMPT)["input_ids"]


def test_completions_match_local_greedy(gateway):
    expected, num_new = gateway.greedy(prompt_ids(gateway), 12)
    out = gateway.client.completions.create(model=MODEL_ID, prompt=PROMPT, max_tokens=12, temperature=0)
    assert out.choices[0].text == expected
    assert out.usage.prompt_tokens == len(prompt_ids(gateway))
    assert out.usage.completion_tokens == num_new
    assert out.choices[0].finish_reason == ("length" if num_new == 12 else "stop")

    chunks = list(
        gateway.client.completions.create(model=MODEL_ID, prompt=PROMPT, max_tokens=12, temperature=0, stream=True)
    )
    assert "".join(c.choices[0].text for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == out.choices[0].finish_reason


def test_chat_matches_local_greedy(gateway):
    messages = [{"role": "user", "content": "Hi there"}]
    ids = gateway.tokenizer(plain_chat_prompt(messages))["input_ids"]  # the tiny tokenizer has no chat template
    expected, num_new = gateway.greedy(ids, 10)
    out = gateway.client.chat.completions.create(model=MODEL_ID, messages=messages, max_tokens=10, temperature=0)
    assert out.choices[0].message.content == expected
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (len(ids), num_new)
    chunks = list(
        gateway.client.chat.completions.create(
            model=MODEL_ID, messages=messages, max_tokens=10, temperature=0, stream=True
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected


def test_stop_sequence_cut(gateway):
    full, _ = gateway.greedy(prompt_ids(gateway), 16)
    candidates = [full[i : i + 2] for i in range(3, len(full) - 2) if "\ufffd" not in full[i : i + 2]]
    assert candidates, f"no usable stop sequence in {full!r}"
    stop = candidates[0]
    expected = full[: full.index(stop)]
    out = gateway.client.completions.create(model=MODEL_ID, prompt=PROMPT, max_tokens=16, temperature=0, stop=[stop])
    assert (out.choices[0].text, out.choices[0].finish_reason) == (expected, "stop")
    chunks = list(
        gateway.client.completions.create(
            model=MODEL_ID, prompt=PROMPT, max_tokens=16, temperature=0, stop=[stop], stream=True
        )
    )
    assert "".join(c.choices[0].text for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_eight_concurrent_streams(gateway):
    expected, _ = gateway.greedy(prompt_ids(gateway), 8)
    results: list = [None] * 8

    def one(i: int) -> None:
        try:
            stream = gateway.client.completions.create(
                model=MODEL_ID, prompt=PROMPT, max_tokens=8, temperature=0, stream=True
            )
            results[i] = "".join(c.choices[0].text for c in stream)
        except Exception as e:  # reported below
            results[i] = e

    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert results == [expected] * 8


def test_bad_requests(gateway):
    request = urllib.request.Request(
        gateway.base_url + "/completions", data=b"{not json", headers={"Content-Type": "application/json"}
    )
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(request, timeout=30)
    assert e.value.code == 400
    assert json.loads(e.value.read())["error"]["type"] == "invalid_request_error"

    with pytest.raises(openai.NotFoundError):
        gateway.client.completions.create(model="gpt-unknown", prompt=PROMPT)
    with pytest.raises(openai.BadRequestError) as e:
        gateway.client.completions.create(model=MODEL_ID, prompt=PROMPT, max_tokens=-1)
    assert e.value.body["param"] == "max_tokens"


def test_logprobs_match_local_log_softmax(gateway):
    ids = prompt_ids(gateway)
    tokens = greedy_ids(gateway, ids, 4)
    out = gateway.client.completions.create(model=MODEL_ID, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=2)
    lp = out.choices[0].logprobs
    assert len(lp.token_logprobs) == out.usage.completion_tokens == len(tokens)
    with torch.no_grad():
        logits = gateway.reference(torch.tensor([ids + tokens])).logits[0].float()  # [T, V]
    reference = torch.log_softmax(logits, dim=-1)
    for step, token in enumerate(tokens):
        row = reference[len(ids) - 1 + step]  # the distribution the step-th new token was drawn from
        assert lp.token_logprobs[step] == pytest.approx(float(row[token]), abs=2e-3)
        assert lp.tokens[step] == gateway.tokenizer.decode([token], skip_special_tokens=True)
        best = max(lp.top_logprobs[step].values())
        assert best == pytest.approx(float(row.max()), abs=2e-3)


def greedy_ids(gateway: Gateway, ids: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = gateway.reference.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(ids) :].tolist()


def test_vllm_params_on_the_real_model(gateway):
    ids = prompt_ids(gateway)
    greedy = greedy_ids(gateway, ids, 8)
    stop_at = next(i for i in range(2, 8) if greedy[i] not in greedy[:i])  # a token not generated before it
    out = gateway.client.completions.create(
        model=MODEL_ID, prompt=PROMPT, max_tokens=8, temperature=0, extra_body={"stop_token_ids": [greedy[stop_at]]}
    )
    assert out.choices[0].text == gateway.tokenizer.decode(greedy[:stop_at], skip_special_tokens=True)
    assert (out.choices[0].finish_reason, out.usage.completion_tokens) == ("stop", stop_at + 1)

    # generation_config.json says top_k=1: a request that leaves top_k unset samples the argmax only
    expected, _ = gateway.greedy(ids, 6)
    for seed in (1, 2):
        out = gateway.client.completions.create(model=MODEL_ID, prompt=PROMPT, max_tokens=6, temperature=1.0, seed=seed)
        assert out.choices[0].text == expected
    sampled = {
        gateway.client.completions.create(
            model=MODEL_ID, prompt=PROMPT, max_tokens=6, temperature=1.0, seed=seed, extra_body={"top_k": -1}
        )
        .choices[0]
        .text
        for seed in (1, 2, 3)
    }
    assert sampled != {expected}  # top_k=-1 (off) in the request wins over the default


def test_service_routes_and_model_names(gateway):
    root = gateway.base_url.removesuffix("/v1")
    with urllib.request.urlopen(root + "/health", timeout=10) as response:
        assert response.status == 200
    body = json.dumps({"model": MODEL_ID, "prompt": PROMPT}).encode()
    request = urllib.request.Request(root + "/tokenize", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=10) as response:
        tokenized = json.loads(response.read())
    assert tokenized["tokens"] == prompt_ids(gateway) and tokenized["count"] == len(prompt_ids(gateway))
    body = json.dumps({"model": MODEL_ID, "tokens": tokenized["tokens"]}).encode()
    request = urllib.request.Request(root + "/detokenize", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=10) as response:
        assert json.loads(response.read())["prompt"] == gateway.tokenizer.decode(
            tokenized["tokens"], skip_special_tokens=True
        )

    assert [m.id for m in gateway.client.models.list().data] == [MODEL_ID]  # the local path is not listed...
    out = gateway.client.completions.create(model=str(gateway.model_path), prompt=PROMPT, max_tokens=2, temperature=0)
    assert out.model == str(gateway.model_path)  # ...but accepted
    with urllib.request.urlopen(root + "/metrics", timeout=10) as response:
        text = response.read().decode()
    values = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples if not s.labels}
    assert values["corolla_api_time_to_first_token_seconds_count"] >= 1
    assert values["corolla_api_generation_tokens_total"] >= 2


def test_server_metrics_move_across_a_generation(gateway):
    port = gateway.servers[0].config.metrics_port
    active, opened = ("corolla_sessions_active", ()), ("corolla_sessions_opened_total", ())
    tokens = ("corolla_tokens_processed_total", (("kind", "inference"),))
    before = scrape(port)
    assert before[active] == 0

    peak_active, done = [0.0], threading.Event()

    def poll() -> None:  # watches the gauge while the generation runs
        while not done.is_set():
            peak_active[0] = max(peak_active[0], scrape(port)[active])
            time.sleep(0.01)

    poller = threading.Thread(target=poll)
    poller.start()
    try:
        # long enough for the poller's scrapes to land inside it on a loaded machine (30 tokens: missed once)
        out = gateway.client.completions.create(model=MODEL_ID, prompt=PROMPT, max_tokens=200, temperature=0)
    finally:
        done.set()
        poller.join(10)
    generated = out.usage.completion_tokens

    deadline = time.monotonic() + 15
    while (after := scrape(port))[active] != 0 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert peak_active[0] >= 1  # up during the generation...
    assert after[active] == 0  # ...and down after it
    assert after[opened] - before[opened] >= 1
    # the prompt in one step, then each generated token but the last is fed back
    assert after[tokens] - before[tokens] >= len(prompt_ids(gateway)) + generated - 1
    assert after[("corolla_step_seconds_count", ())] > before[("corolla_step_seconds_count", ())]


def test_missing_block_is_503(gateway):
    """Runs last: stops the server of blocks 2:4, so the swarm cannot serve the model any more."""
    second = gateway.servers[1]
    second.shutdown()  # a clean stop, as SIGTERM to a server process
    with pytest.raises(openai.InternalServerError) as e:
        gateway.client.completions.create(model=MODEL_ID, prompt=PROMPT, max_tokens=4, temperature=0)
    assert e.value.status_code == 503
    assert e.value.body["code"] == "missing_blocks"
    assert e.value.body["missing_blocks"] == [2, 3]
