"""The chat page of `corolla-api` (its CLI, as a process, with an API key) over a loopback swarm of two servers (in
this process), driven in headless Chromium: the key field unlocks the gateway, a prompt streams text into the page, Stop aborts the
fetch and the gateway's generation ends (its inference session closes, no more steps), and the route panel shows the
two servers (peer ids, spans) exactly as `/corolla/route/<id>` reports them. One server announces a hostile
`public_name` (HTML with an event handler): the page shows it as text. The Content-Security-Policy refuses outside
loads. Screenshot: test-artifacts/chat-page.png. Skips when Chromium or Playwright is missing."""

from __future__ import annotations

import json
import signal
import sys
import time
import urllib.error
import urllib.request
from contextlib import ExitStack

import pytest

from helpers.browser import ARTIFACTS, headless_page
from helpers.swarm import ManagedProcess, Swarm, inprocess_servers
from helpers.tiny_models import make_tiny_model

API_BANNER = "corolla-api: serving "
API_KEY = "chat-page-test-key"
HOSTILE_NAME = '<img src=x onerror="window.pwned=1">srv2'
SPANS = ((0, 2), (2, 4))
MAX_TOKENS = 400  # far more than the test waits for: the generation is still running when Stop is pressed

pytestmark = pytest.mark.timeout(240)


def get_json(url: str, *, key: str | None = API_KEY) -> dict:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=10) as response:
        return json.loads(response.read())


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("chat-swarm")
    model_path = make_tiny_model("llama", workdir / "models")
    swarm = Swarm(workdir)
    stack = ExitStack()
    try:
        swarm.start_bootstrap()
        # the servers run in this process (the page shows what they announce and serve, not how they run); the
        # gateway stays a process (its CLI is under test)
        spans = [(model_path, f"{a}:{b}", {"public_name": HOSTILE_NAME if a else f"srv{a}"}) for a, b in SPANS]
        servers = stack.enter_context(inprocess_servers(spans, workdir / "cache", swarm.initial_peers))
        api = ManagedProcess(
            [
                sys.executable, "-m", "corolla.cli.api", "--model", str(model_path),
                "--initial_peers", *swarm.initial_peers, "--port", "0", "--max_retries", "2", "--api_key", API_KEY,
            ],
            name="corolla-api",
        )  # fmt: skip
        swarm.processes.append(api)
        line = api.wait_for_line(lambda s: s.startswith(API_BANNER), 90)
        url = line.rsplit(" at ", 1)[1].strip().removesuffix("/v1") + "/"
        yield url, servers
    finally:
        for proc in swarm.processes:
            proc.signal(signal.SIGTERM)
        stack.close()
        swarm.close()


def test_route_endpoints_need_the_key(gateway):
    url, _ = gateway
    for path in ("corolla/route", "corolla/route/" + "0" * 32):
        with pytest.raises(urllib.error.HTTPError) as err:
            get_json(url + path, key=None)
        assert err.value.code == 401
    with pytest.raises(urllib.error.HTTPError) as err:
        get_json(url + "corolla/route/" + "0" * 32)
    assert err.value.code == 404
    with pytest.raises(urllib.error.HTTPError) as err:
        get_json(url + "static/../app.py")
    assert err.value.code == 404


def test_chat_streams_stops_and_shows_route(gateway):
    url, servers = gateway
    with headless_page(1280, 720) as page:
        page.add_init_script(
            """window.cspViolations = [];
            document.addEventListener('securitypolicyviolation',
                (e) => window.cspViolations.push(e.violatedDirective + ' ' + e.blockedURI));"""
        )
        external: list[str] = []
        page.on("request", lambda r: None if r.url.startswith(url) else external.append(r.url))
        response = page.goto(url)
        csp = response.headers["content-security-policy"]
        assert "default-src 'none'" in csp and "script-src 'self'" in csp and "connect-src 'self'" in csp

        # without the key the gateway refuses; with it, the model list loads
        page.wait_for_function("() => document.getElementById('status').textContent.includes('API key')")
        page.fill("#api-key", API_KEY)
        page.dispatch_event("#api-key", "change")
        page.wait_for_function("() => document.querySelectorAll('#model option').length === 1")

        page.fill("#temperature", "0")
        page.fill("#max-tokens", str(MAX_TOKENS))
        page.fill("#system", "You are a tiny test model.")
        page.fill("#prompt", "Hello <b>swarm</b>")
        page.focus("#prompt")
        page.keyboard.press("Enter")

        # streamed text arrives while the generation runs
        page.wait_for_function(
            """() => document.body.dataset.state === 'streaming'
               && (document.querySelector('.message.assistant .content')?.textContent.length || 0) >= 8
               && document.querySelectorAll('#route-hops tr.hop').length === 2""",
            timeout=60_000,
        )
        assert page.locator(".message.user b").count() == 0  # the user's text is text, not markup
        assert page.locator(".message.user .content").text_content() == "Hello <b>swarm</b>"
        page.click("#stop")
        page.wait_for_function("() => document.body.dataset.state === 'stopped'", timeout=30_000)
        shown = page.locator(".message.assistant .content").text_content()
        assert 8 <= len(shown) < MAX_TOKENS

        # the gateway stopped generating: its session is closed and no more steps run
        route_id = page.evaluate("() => window.renderedRoute.id")
        trace = get_json(url + f"corolla/route/{route_id}")
        assert trace["state"] == "finished"
        time.sleep(1.0)
        assert get_json(url + f"corolla/route/{route_id}")["steps"] == trace["steps"]
        assert len(shown) <= trace["steps"] < MAX_TOKENS  # one character per token, at most one step more

        # the route panel shows the two servers, exactly as the gateway reports them
        hops = [(h["peer_id"], h["start"], h["end"]) for h in trace["route"]]
        assert hops == [(s.peer_id, a, b) for s, (a, b) in zip(servers, SPANS, strict=True)]
        assert page.evaluate("() => window.renderedRoute") == trace
        rows = page.evaluate(
            """() => [...document.querySelectorAll('#route-hops tr.hop')].map(
                (tr) => [tr.dataset.peerId, Number(tr.dataset.start), Number(tr.dataset.end)])"""
        )
        assert [tuple(r) for r in rows] == hops
        assert page.locator("#route").get_attribute("data-state") == "finished"
        # a server's hostile name is shown as text: no element made, no handler run
        assert page.get_by_text(HOSTILE_NAME).count() == 1
        assert page.locator("#route img").count() == 0
        assert page.evaluate("() => window.pwned") is None
        assert get_json(url + "corolla/route?limit=1")["generations"][0]["id"] == route_id

        page.screenshot(path=str(ARTIFACTS / "chat-page.png"))
        assert external == []  # nothing was fetched from outside the gateway
        assert page.evaluate("() => window.cspViolations") == []  # the page lives within its own policy

        # the policy refuses a load from outside the gateway
        violation = page.evaluate(
            """() => new Promise((resolve) => {
                document.addEventListener('securitypolicyviolation', (e) => resolve(e.violatedDirective));
                const img = document.createElement('img');
                img.src = 'http://192.0.2.1/pixel.png';
                document.body.appendChild(img);
                setTimeout(() => resolve(null), 3000);
            })"""
        )
        assert violation == "img-src"
