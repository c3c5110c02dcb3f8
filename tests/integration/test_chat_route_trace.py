"""The chat page's server side over an in-process backend that reports made-up routes (no swarm): the page and its
files under the Content-Security-Policy, `/corolla/route` per request (concurrent requests each see their own route,
a fail-over mid-generation counts as a route change), the API key, the bounded log, tracking off, and a client that
goes away mid-stream ending the generation (the browser test does the same over a real swarm)."""

from __future__ import annotations

import http.client
import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit

import pytest
import torch

from corolla.api.app import ApiConfig, create_app
from corolla.api.backend import plain_chat_prompt
from corolla.api.chat_page import CONTENT_SECURITY_POLICY
from corolla.api.route_trace import (
    MAX_PUBLIC_NAME_CHARS,
    MAX_ROUTE_HOPS,
    ROUTE_ID_HEADER,
    GenerationTrace,
    RouteLog,
    current_trace,
    hops_of,
)
from corolla.api.serving import serve_in_thread

MODEL = "fake/routed"
NUM_LOGITS = 64
EOS = 0


@dataclass
class FakeInfo:
    public_name: object = None


@dataclass
class FakeSpan:
    peer_id: str
    start: int
    end: int
    server_info: FakeInfo


def route_for(prompt: str, step: int) -> list[tuple[FakeSpan, str]]:
    """Two servers named after the prompt's last word; "failover" swaps the second one from step 3 on."""
    tag = prompt.splitlines()[0].split()[-1]  # the plain chat prompt: "user: ... TAG\nassistant:"
    second = f"{tag}-B2" if "failover" in prompt and step >= 3 else f"{tag}-B"
    return [
        (FakeSpan(f"{tag}-A", 0, 2, FakeInfo(f"name-{tag}")), "p2p"),
        (FakeSpan(second, 2, 4, FakeInfo(None)), "local"),
    ]


class RoutedBackend:
    """Text "abcabc..." under any sampling (never EOS), `token_delay_s` per step; reports `route_for(prompt, step)` each step
    as `SwarmBackend` reports its session's chain."""

    model_id = MODEL
    max_context_tokens = 4096
    vocab_size = 0x110001  # prompts encode as 1 + ord(c) (invertible: the route depends on the prompt)
    eos_token_ids = frozenset([EOS])
    generation_defaults: dict = {}

    def __init__(self, token_delay_s: float = 0.0):
        self.token_delay_s = token_delay_s
        self.closed = threading.Event()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [1 + ord(c) for c in text]

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(chr(ord("a") + (i - 1) % 3) for i in ids if i != EOS)

    def chat_prompt_ids(self, messages: list[dict[str, str]]) -> list[int]:
        return self.encode(plain_chat_prompt(messages))

    def step_logits(self, prompt_ids: list[int], max_length: int) -> Iterator[torch.Tensor]:
        prompt = "".join(chr(i - 1) for i in prompt_ids)
        trace = current_trace()
        try:
            for step in range(max_length - len(prompt_ids)):
                time.sleep(self.token_delay_s)
                trace.step(route_for(prompt, step))
                # every other token (EOS too) impossible: requests sample at the API's default temperature 1.0,
                # under which a margin of 10 still drew another token now and then (EOS ~1 step in 22,000)
                logits = torch.full((NUM_LOGITS,), float("-inf"))
                logits[1 + step % 3] = 0.0
                yield logits
        finally:
            trace.finish()
            self.closed.set()


def post_chat(url: str, prompt: str, *, key: str | None = None, stream: bool = False, max_tokens: int = 6):
    body = {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens}
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    request = urllib.request.Request(
        url + "/v1/chat/completions", data=json.dumps({**body, "stream": stream}).encode(), headers=headers
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        return response.headers.get(ROUTE_ID_HEADER), response.read()


def get(url: str, *, key: str | None = None) -> tuple[int, dict[str, str], bytes]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=10) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


@pytest.fixture
def gateway():
    def start(config: ApiConfig | None = None, token_delay_s: float = 0.0):
        backend = RoutedBackend(token_delay_s)
        running = serve_in_thread(create_app(backend, config or ApiConfig()))
        servers.append(running)
        return running.url, backend

    servers: list = []
    yield start
    for running in servers:
        running.close()


def test_page_and_files_under_csp(gateway):
    url, _ = gateway()
    status, headers, body = get(url + "/")
    assert status == 200 and headers["content-security-policy"] == CONTENT_SECURITY_POLICY
    assert b'<script src="static/chat.js"' in body and b"<script>" not in body and b"style=" not in body
    status, headers, body = get(url + "/static/chat.js")
    assert status == 200 and headers["content-type"].startswith("text/javascript") and b"innerHTML" not in body
    assert get(url + "/static/chat.css")[0] == 200
    for path in ("/static/index.html", "/static/..%2Fapp.py", "/static/%2e%2e/backend.py", "/static/nope.js"):
        assert get(url + path)[0] == 404, path


def test_each_request_sees_its_own_route(gateway):
    url, backend = gateway(token_delay_s=0.01)
    prompts = [f"hello from {tag}" for tag in ("alpha", "beta", "gamma", "delta")] + ["failover at omega"]
    results: dict[str, str] = {}

    def run(prompt: str) -> None:
        route_id, _ = post_chat(url, prompt, stream=prompt.startswith("hello from b"), max_tokens=8)
        results[prompt] = route_id

    threads = [threading.Thread(target=run, args=(p,)) for p in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(set(results.values())) == len(prompts)
    for prompt, route_id in results.items():
        tag = prompt.split()[-1]
        status, _, body = get(url + f"/corolla/route/{route_id}")
        trace = json.loads(body)
        assert status == 200 and trace["state"] == "finished" and trace["steps"] == 8
        second = f"{tag}-B2" if "failover" in prompt else f"{tag}-B"
        assert [(h["peer_id"], h["start"], h["end"], h["transport"]) for h in trace["route"]] == [
            (f"{tag}-A", 0, 2, "p2p"),
            (second, 2, 4, "local"),
        ]
        assert trace["route"][0]["public_name"] == f"name-{tag}" and trace["route"][1]["public_name"] is None
        assert trace["route_changes"] == (1 if "failover" in prompt else 0)
    recent = json.loads(get(url + "/corolla/route?limit=64")[2])["generations"]
    assert {g["id"] for g in recent} == set(results.values())


def test_key_required_and_refused_requests_leave_nothing(gateway):
    url, _ = gateway(ApiConfig(api_key="k3y"))
    with pytest.raises(urllib.error.HTTPError) as err:
        post_chat(url, "hello from x")
    assert err.value.code == 401 and err.value.headers.get(ROUTE_ID_HEADER) is None
    assert get(url + "/corolla/route")[0] == 401
    assert json.loads(get(url + "/corolla/route", key="k3y")[2])["generations"] == []
    route_id, _ = post_chat(url, "hello from x", key="k3y")
    assert get(url + f"/corolla/route/{route_id}")[0] == 401
    assert get(url + f"/corolla/route/{route_id}", key="k3y")[0] == 200
    assert get(url + "/")[0] == 200  # the page holds no secret: it asks for the key
    assert get(url + "/corolla/route?limit=0", key="k3y")[0] == 400
    assert get(url + "/corolla/route?limit=65", key="k3y")[0] == 400
    assert get(url + "/corolla/route/" + "x" * 5000, key="k3y")[0] == 404


def test_log_is_bounded_and_can_be_off(gateway):
    url, backend = gateway(ApiConfig(route_log_entries=3))
    ids = [post_chat(url, "hello from x", max_tokens=1)[0] for _ in range(5)]
    recent = json.loads(get(url + "/corolla/route?limit=64")[2])
    assert recent["route_log_entries"] == 3
    assert [g["id"] for g in recent["generations"]] == ids[::-1][:3]
    assert get(url + f"/corolla/route/{ids[0]}")[0] == 404  # the oldest were dropped

    url, backend = gateway(ApiConfig(route_log_entries=0))
    route_id, _ = post_chat(url, "hello from x", max_tokens=1)
    assert route_id is None
    assert json.loads(get(url + "/corolla/route")[2])["generations"] == []
    with pytest.raises(ValueError, match="route_log_entries"):
        create_app(backend, ApiConfig(route_log_entries=-1))


def test_client_gone_mid_stream_ends_the_generation(gateway):
    url, backend = gateway(token_delay_s=0.02)
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=10)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hello from stopper"}], "max_tokens": 2000}
    conn.request(
        "POST", "/v1/chat/completions", json.dumps({**body, "stream": True}), {"Content-Type": "application/json"}
    )
    response = conn.getresponse()
    route_id = response.getheader(ROUTE_ID_HEADER)
    for _ in range(5):
        assert response.fp.readline()
    conn.close()  # what the page's Stop does: the fetch is aborted
    assert backend.closed.wait(5), "the generation went on after the client left"
    trace = json.loads(get(url + f"/corolla/route/{route_id}")[2])
    assert trace["state"] == "finished" and trace["steps"] < 100
    time.sleep(0.2)
    assert json.loads(get(url + f"/corolla/route/{route_id}")[2])["steps"] == trace["steps"]


def test_hops_of_bounds_server_text():
    long_name = "<b>" * 100
    (hop,) = hops_of([(FakeSpan("p", 0, 1, FakeInfo(long_name)), None)])
    assert hop.public_name == long_name[:MAX_PUBLIC_NAME_CHARS]
    (hop,) = hops_of([(FakeSpan("p", 0, 1, FakeInfo(12345)), None)])
    assert hop.public_name is None


def test_long_routes_are_cut():
    """A chain of 4096 one-block servers (hostile servers can announce tiny spans): the log keeps its first
    MAX_ROUTE_HOPS hops and says so; the same chain stepped again is not converted again."""
    log = RouteLog(4)
    route = [(FakeSpan(f"peer{i}", i, i + 1, FakeInfo(f"s{i}")), "p2p") for i in range(4096)]
    trace = GenerationTrace(log)
    trace.step(route)
    first_hops = trace.hops
    trace.step(route)
    trace.finish()
    view = trace.to_dict()
    assert len(view["route"]) == MAX_ROUTE_HOPS and view["route_truncated"] is True
    assert view["route"][-1]["peer_id"] == f"peer{MAX_ROUTE_HOPS - 1}"
    assert view["steps"] == 2 and view["route_changes"] == 0 and trace.hops is first_hops
    assert view["state"] == "finished" and log.get(trace.id) is trace
