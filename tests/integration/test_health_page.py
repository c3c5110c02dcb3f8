"""`corolla-health` (its CLI, as a process) watching a loopback swarm of three servers (in this process), its page opened in headless
Chromium (a 1280-pixel window, which the page fits): every server listed, a complete coverage bar and the swarm's
flow line, then a red gap once a server stops; the page shows exactly what `/api/v1/state` says. Screenshots go to
test-artifacts/. Skips when Chromium or Playwright is missing."""

from __future__ import annotations

import json
import sys
import time
import urllib.request

import pytest

from helpers.browser import ARTIFACTS, headless_page
from helpers.swarm import ManagedProcess, bootstrapped, inprocess_servers
from helpers.tiny_models import make_tiny_model

HEALTH_BANNER = "corolla-health: serving at "
SPANS = ((0, 2), (2, 4), (4, 6))

pytestmark = pytest.mark.timeout(240)


def fetch_state(url: str) -> dict:
    with urllib.request.urlopen(url + "api/v1/state", timeout=10) as response:
        return json.loads(response.read())


def page_view(page) -> dict:
    """What the page shows, read from the DOM: rows (peer id -> state, blocks text) and block states."""
    return page.evaluate(
        """() => ({
            rows: Object.fromEntries([...document.querySelectorAll('tr.server-row')].map(
                (tr) => [tr.dataset.peerId, [tr.dataset.state, tr.children[2].textContent.trim()]])),
            blocks: [...document.querySelectorAll('.coverage .block')].map(
                (b) => [b.className.replace('block ', '').split(' ')[0], Number(b.dataset.servers)]),
            rendered: window.renderedState,
        })"""
    )


def view_of_state(state: dict) -> dict:
    (report,) = state["model_reports"]
    return {
        "rows": {r["peer_id"]: [r["state"], f"{r['span']['start']}:{r['span']['end']}"] for r in report["server_rows"]},
        "blocks": [[b["state"], b["num_servers"]] for b in report["blocks"]],
    }


def assert_page_matches_api(page, url: str, timeout_s: float = 15.0) -> dict:
    """The DOM shows exactly the document the page fetched, and that document is what the API serves (retried
    briefly: the monitor may refresh between the page's fetch and ours)."""
    deadline = time.monotonic() + timeout_s
    while True:
        view = page_view(page)
        rendered = view.pop("rendered")
        assert view == view_of_state(rendered)
        if view == view_of_state(fetch_state(url)):
            return view
        assert time.monotonic() < deadline, f"page {view} never matched the API"
        time.sleep(0.3)


@pytest.fixture(scope="module")
def monitored_swarm(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("health-swarm")
    model_path = make_tiny_model("llama", workdir / "models", num_layers=6)
    with bootstrapped(workdir) as swarm:
        # the monitor starts alongside the servers (it refreshes every second), which saves start-up time
        health = ManagedProcess(
            [
                sys.executable, "-m", "corolla.cli.health", "--initial_peers", *swarm.initial_peers,
                "--model", str(model_path), "--refresh_period", "1", "--ping_timeout", "2", "--port", "0",
            ],
            name="corolla-health",
        )  # fmt: skip
        swarm.processes.append(health)
        # the servers run in this process (the page shows what they announce, not how they run): three interpreter
        # start-ups less; the monitor stays a process (its CLI is under test)
        spans = [(model_path, f"{a}:{b}", {"public_name": f"srv{a}"}) for a, b in SPANS]
        with inprocess_servers(spans, workdir / "cache", swarm.initial_peers) as servers:
            line = health.wait_for_line(lambda s: s.startswith(HEALTH_BANNER), 90)
            yield swarm, servers, line[len(HEALTH_BANNER) :].strip()


def test_page_shows_servers_then_gap(monitored_swarm):
    swarm, servers, url = monitored_swarm
    with headless_page(1280, 700) as page:
        external = []
        page.on("request", lambda r: None if r.url.startswith(url) else external.append(r.url))
        page.goto(url)

        # all three servers online and every block covered (bounded wait for announcements and refreshes)
        page.wait_for_function(
            """() => document.querySelectorAll('tr.server-row[data-state="online"]').length === 3
               && document.querySelectorAll('.coverage .block').length === 6
               && document.querySelectorAll('.coverage .block.gap').length === 0""",
            timeout=60_000,
        )
        page.screenshot(path=str(ARTIFACTS / "health-complete.png"), full_page=True)
        view = assert_page_matches_api(page, url)
        # everything fits a 1280-pixel window: no horizontal scrolling
        assert page.evaluate("() => document.documentElement.scrollWidth") <= 1280
        flow = page.get_by_test_id("flow").inner_text()
        assert "max-flow" in flow and "tok/s" in flow and "moves 0" in flow
        assert set(view["rows"]) == {s.peer_id for s in servers}
        assert {tuple(v) for v in view["rows"].values()} == {("online", f"{a}:{b}") for a, b in SPANS}
        assert view["blocks"] == [["online", 1]] * 6
        assert page.locator("section.model").get_attribute("data-state") == "healthy"
        for a, _ in SPANS:
            assert page.get_by_text(f"srv{a}").count() == 1

        # one server leaves: its blocks become a red gap
        servers[2].shutdown()  # a clean stop, as SIGTERM to a server process
        page.wait_for_function(
            """() => document.querySelectorAll('.coverage .block.gap').length === 2""", timeout=60_000
        )
        page.screenshot(path=str(ARTIFACTS / "health-gap.png"), full_page=True)
        view = assert_page_matches_api(page, url)
        assert [b[0] for b in view["blocks"]] == ["online"] * 4 + ["gap"] * 2
        # its row says offline/unreachable until its records expire, then it is gone
        assert view["rows"].get(servers[2].peer_id, ["gone"])[0] in ("offline", "unreachable", "gone")
        assert [view["rows"][s.peer_id][0] for s in servers[:2]] == ["online", "online"]
        assert page.locator("section.model").get_attribute("data-state") == "broken"
        # read the colour from the element on the page now, in one evaluation: the page re-renders on each
        # refresh, and a node detached between finding and reading it has no computed style ('')
        gap_color = page.evaluate(
            """() => { const b = document.querySelector('.coverage .block.gap');
                       return b ? getComputedStyle(b).backgroundColor : 'no gap block'; }"""
        )
        assert gap_color == "rgb(209, 52, 47)"  # red
        assert external == []  # nothing loaded from outside the monitor
