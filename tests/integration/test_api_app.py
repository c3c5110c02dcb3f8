"""corolla-api over a scripted in-process backend, driven by the official `openai` client and raw HTTP:
response/chunk formats, stop cutting across tokens, errors and concurrency (the swarm itself is in test_api_swarm)."""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence

import openai
import pytest
import torch

from corolla.api.admission import Admission
from corolla.api.app import ApiConfig, create_app
from corolla.api.backend import plain_chat_prompt
from corolla.api.serving import serve_in_thread
from corolla.utils.errors import MissingBlocksError
from helpers.api_client import openai_client

MODEL = "fake/scripted-model"
EOS = 0
VOCAB = ["<eos>", "Hel", "lo", " wo", "rld", "!", " ST", "OP", " and", " more", "\n"]
SCRIPT = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]  # "Hello world! STOP and more\n"
CHAR_BASE = 100  # prompt characters encode as CHAR_BASE + ord(c)
JSON = {"Content-Type": "application/json"}


class ScriptedBackend:
    """Logits over VOCAB (ids < len(VOCAB)): the argmax follows SCRIPT, then EOS; every other token gets seeded noise
    (a function of the prompt and step), so sampling really samples. EOS is impossible before SCRIPT ends."""

    model_id = MODEL
    max_context_tokens = 256
    vocab_size = CHAR_BASE + 0x110000
    eos_token_ids = frozenset([EOS])
    generation_defaults: dict = {}

    def __init__(self, token_delay_s: float = 0.0):
        self.token_delay_s = token_delay_s
        self.active = 0
        self.peak_active = 0
        self.closed_sessions = 0
        self.sent: list[list[int]] = []  # tokens sent back to each session, in order
        self.sent_prompts: list[list[int]] = []  # each session's prompt, in the same order
        self._lock = threading.Lock()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [CHAR_BASE + ord(c) for c in text]

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(VOCAB[i] if i < CHAR_BASE else chr(i - CHAR_BASE) for i in ids if i != EOS)

    def chat_prompt_ids(self, messages: list[dict[str, str]]) -> list[int]:
        return self.encode(plain_chat_prompt(messages))

    def logits_at(self, prompt_ids: list[int], step: int) -> torch.Tensor:
        noise = torch.Generator().manual_seed(hash((tuple(prompt_ids), step)) % 2**31)
        logits = torch.randn(len(VOCAB), generator=noise)
        favored = SCRIPT[step] if step < len(SCRIPT) else EOS
        logits[EOS] = float("-inf") if step < len(SCRIPT) else logits[EOS]
        logits[favored] = logits.max() + 0.5
        return logits

    def step_logits(self, prompt_ids: list[int], max_length: int) -> Iterator[torch.Tensor]:
        prompt = self.decode(prompt_ids)
        if "missing" in prompt:
            raise MissingBlocksError([2, 3])
        with self._lock:
            self.active += 1
            self.peak_active = max(self.peak_active, self.active)
            sent: list[int] = []
            self.sent.append(sent)
            self.sent_prompts.append(list(prompt_ids))
        try:
            step = 0
            while len(prompt_ids) + step < max_length:
                time.sleep(self.token_delay_s)
                sent.append((yield self.logits_at(prompt_ids, step)))
                step += 1
            raise AssertionError(f"the app asked for more than max_length={max_length} tokens")
        finally:
            with self._lock:
                self.active -= 1
                self.closed_sessions += 1


def script_text(n: int) -> str:
    return "".join(VOCAB[t] for t in SCRIPT[:n])


@pytest.fixture(scope="module")
def backend():
    return ScriptedBackend(token_delay_s=0.01)


@pytest.fixture(scope="module")
def api(backend):
    with serve_in_thread(create_app(backend, ApiConfig(model_aliases=("alias",)))) as running:
        yield running


@pytest.fixture()
def client(api):
    return openai_client(api.url)


def post_raw(url: str, body: bytes, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def test_models(client):
    ids = {m.id for m in client.models.list().data}
    assert ids == {MODEL, "alias"}
    assert client.models.retrieve(MODEL).id == MODEL


def test_completion_greedy(client):
    out = client.completions.create(model=MODEL, prompt="Say hi", max_tokens=5, temperature=0)
    assert out.object == "text_completion"
    assert out.choices[0].text == script_text(5) == "Hello world!"
    assert out.choices[0].finish_reason == "length"
    assert (out.usage.prompt_tokens, out.usage.completion_tokens, out.usage.total_tokens) == (6, 5, 11)


def test_completion_eos_finishes_with_stop(client):
    out = client.completions.create(model=MODEL, prompt="x", max_tokens=50, temperature=0)
    assert out.choices[0].text == script_text(len(SCRIPT))
    assert out.choices[0].finish_reason == "stop"
    assert out.usage.completion_tokens == len(SCRIPT) + 1  # the EOS token was generated too


def test_stream_matches_non_stream(client):
    full = client.completions.create(model=MODEL, prompt="abc", max_tokens=8, temperature=0)
    chunks = list(client.completions.create(model=MODEL, prompt="abc", max_tokens=8, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == full.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])
    assert len({c.id for c in chunks}) == 1


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    "stop, expected",
    [
        ("lo w", "Hel"),  # spans the tokens "lo" and " wo"
        (["zzz", "d!"], "Hello worl"),  # inside "rld" + "!"
        (" STOP", "Hello world!"),  # exactly two tokens
        ("H", ""),  # at the very start
        ("never", "Hello world! STOP and"),  # no hit: length
    ],
)
def test_stop_sequences_cut(client, stream, stop, expected):
    kwargs = dict(model=MODEL, prompt="p", max_tokens=8, temperature=0, stop=stop)
    if stream:
        chunks = list(client.completions.create(stream=True, **kwargs))
        text = "".join(c.choices[0].text for c in chunks)
        finish = chunks[-1].choices[0].finish_reason
    else:
        out = client.completions.create(**kwargs)
        text, finish = out.choices[0].text, out.choices[0].finish_reason
    assert text == expected
    assert finish == ("length" if stop == "never" else "stop")


def test_chat_plain_template_and_stream(client):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0)
    assert out.object == "chat.completion"
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == script_text(4)
    assert out.usage.prompt_tokens == len(plain_chat_prompt(messages))
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=4,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == script_text(4)
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 4


def test_chat_stop_and_max_completion_tokens(client):
    out = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "go"}], max_completion_tokens=9, temperature=0, stop="!"
    )
    assert out.choices[0].message.content == "Hello world"
    assert out.choices[0].finish_reason == "stop"


def test_seed_reproducible_sampling(client):
    def sample(seed: int) -> str:
        out = client.completions.create(model=MODEL, prompt="s", max_tokens=12, temperature=1.0, top_p=0.9, seed=seed)
        return out.choices[0].text

    assert sample(1) == sample(1)
    assert len({sample(s) for s in (1, 2, 3)}) > 1


def test_raw_sse_format(api):
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "q"}], "max_tokens": 3, "stream": True})
    status, raw = post_raw(api.url + "/v1/chat/completions", body.encode())
    assert status == 200
    events = [e for e in raw.decode().split("\n\n") if e and not e.startswith(":")]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e[len("data: ") :]) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunks[-1]["choices"][0] == {
        "index": 0,
        "delta": {},
        "logprobs": None,
        "finish_reason": "length",
        "stop_reason": None,
    }
    for c in chunks:
        assert c["object"] == "chat.completion.chunk" and c["model"] == MODEL and c["id"].startswith("chatcmpl-")


def test_errors(api, client):
    status, raw = post_raw(api.url + "/v1/completions", b'{"model": "x", "prompt": ')
    assert status == 400
    error = json.loads(raw)["error"]
    assert set(error) >= {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"

    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="no-such-model", prompt="x")
    assert e.value.body["code"] == "model_not_found"

    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="x", max_tokens=-3)
    assert e.value.body["param"] == "max_tokens"

    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], n=99)
    assert e.value.body["param"] == "n"

    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="x", max_tokens=1000)
    assert e.value.body["code"] == "context_length_exceeded"

    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="x", temperature=3.5)

    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=[5, 5_000_000], max_tokens=2)
    assert e.value.body["param"] == "prompt"

    for stream in (False, True):
        with pytest.raises(openai.InternalServerError) as e:
            client.completions.create(model=MODEL, prompt="missing blocks", stream=stream)
        assert e.value.status_code == 503
        assert e.value.body["missing_blocks"] == [2, 3] and "[2, 3]" in e.value.body["message"]

    status, raw = post_raw(api.url + "/v1/nowhere", b"{}")
    assert status == 404 and "error" in json.loads(raw)


def test_api_key():
    backend = ScriptedBackend()
    with serve_in_thread(create_app(backend, ApiConfig(api_key="sekret"))) as running:
        bad = openai.OpenAI(base_url=running.url + "/v1", api_key="wrong", max_retries=0, timeout=10)
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
        with pytest.raises(openai.AuthenticationError):
            bad.completions.create(model=MODEL, prompt="x")
        good = openai.OpenAI(base_url=running.url + "/v1", api_key="sekret", max_retries=0, timeout=10)
        assert good.completions.create(model=MODEL, prompt="x", max_tokens=2, temperature=0).choices[0].text == "Hello"


def test_concurrent_streams_run_concurrently(api, backend, client):
    results: list[str | BaseException] = [None] * 8
    backend.peak_active = 0
    closed_before = backend.closed_sessions

    def one(i: int) -> None:
        try:
            chunks = client.completions.create(model=MODEL, prompt=f"r{i}", max_tokens=10, temperature=0, stream=True)
            results[i] = "".join(c.choices[0].text for c in chunks)
        except BaseException as e:
            results[i] = e

    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert results == [script_text(10)] * 8
    assert backend.peak_active >= 4  # sessions overlapped rather than queueing one by one
    assert backend.closed_sessions - closed_before == 8


def _post_and_keep(url: str, prompt: str, max_tokens: int, stream: bool = False) -> socket.socket:
    """A raw connection that has posted a completion and reads nothing (the caller hangs up)."""
    body = json.dumps(
        {
            "model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 1.0, "ignore_eos": True,
            "stream": stream,
        }
    ).encode()  # fmt: skip
    host, port = url.split("//")[1].split("/")[0].split(":")
    sock = socket.create_connection((host, int(port)), timeout=10)
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    return sock


def test_a_non_streaming_clients_disconnect_closes_its_session(api, backend):
    """A client that posts a long non-streaming request and hangs up: its generation stops at its next token (it ran
    to max_tokens before, holding a worker thread and the swarm session for nobody)."""
    closed_before, started_before = backend.closed_sessions, len(backend.sent)
    with _post_and_keep(api.url, "n", 240):
        deadline = time.monotonic() + 10
        while len(backend.sent) == started_before and time.monotonic() < deadline:
            time.sleep(0.01)  # the generation started
    deadline = time.monotonic() + 30
    while backend.closed_sessions == closed_before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert backend.closed_sessions == closed_before + 1
    assert len(backend.sent[started_before]) < 200  # of 240 at 10 ms each: stopped within ~2 s of the hang-up


@pytest.mark.parametrize("stream", [False, True])
def test_a_queued_request_whose_client_left_never_opens_a_session(stream):
    """One generation thread, busy: a second request waits for it; its client hangs up meanwhile. When the thread
    frees, the gone request opens no session (before: it ran its prompt's prefill, then stopped)."""
    backend = ScriptedBackend(token_delay_s=0.01)
    with serve_in_thread(create_app(backend, ApiConfig(max_concurrent_requests=1))) as running:
        with _post_and_keep(running.url, "busy", 120):  # 1.2 s of tokens: the gone request's hang-up is seen by then
            deadline = time.monotonic() + 10
            while not backend.sent and time.monotonic() < deadline:
                time.sleep(0.01)
            _post_and_keep(running.url, "gone", 60, stream).close()  # queued behind "busy", then its client leaves
            with _post_and_keep(running.url, "after", 5) as after:  # queued behind both (one thread, in order)
                after.settimeout(30)
                assert after.recv(12).startswith(b"HTTP/1.1 200")
    assert [backend.decode(prompt) for prompt in backend.sent_prompts] == ["busy", "after"]


def test_client_disconnect_closes_session(api, backend, client):
    closed_before = backend.closed_sessions
    stream = client.completions.create(
        model=MODEL, prompt="d", max_tokens=200, temperature=1.0, stream=True, extra_body={"ignore_eos": True}
    )
    next(iter(stream))
    stream.close()
    deadline = time.monotonic() + 10
    while backend.closed_sessions == closed_before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert backend.closed_sessions == closed_before + 1


def test_a_request_past_the_threads_and_their_queue_is_refused_with_retry_after():
    """The attack: no bound on waiting requests (each parsed, its prompt tokenized, waiting in the thread pool's
    queue): a client opening 10,000 requests held them all. With one thread and a queue of one, a third request gets
    429 and Retry-After at once; once the others end, requests get in again."""
    backend = ScriptedBackend(token_delay_s=0.01)
    app = create_app(backend, ApiConfig(max_concurrent_requests=1, max_queued_requests=1, retry_after_s=2))
    body = json.dumps({"model": MODEL, "prompt": "third", "max_tokens": 2}).encode()
    with serve_in_thread(app) as running:
        admission = app.middleware_stack
        while not isinstance(admission, Admission):
            admission = admission.app
        with _post_and_keep(running.url, "busy", 100), _post_and_keep(running.url, "queued", 2):
            deadline = time.monotonic() + 10
            while admission.in_flight < 2 and time.monotonic() < deadline:
                time.sleep(0.01)
            request = urllib.request.Request(running.url + "/v1/completions", data=body, headers=JSON)
            with pytest.raises(urllib.error.HTTPError) as refused:
                urllib.request.urlopen(request, timeout=10)
            assert refused.value.code == 429 and refused.value.headers["Retry-After"] == "2"
            assert json.loads(refused.value.read())["error"]["code"] == "rate_limit_exceeded"
        deadline = time.monotonic() + 30
        while admission.in_flight and time.monotonic() < deadline:
            time.sleep(0.05)
        assert post_raw(running.url + "/v1/completions", body)[0] == 200
    assert "third" in [backend.decode(prompt) for prompt in backend.sent_prompts]
