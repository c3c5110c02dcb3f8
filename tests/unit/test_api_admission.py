"""`api.admission.Admission` at the ASGI level: requests past the total bound or past one address's bound get 429
with Retry-After and never reach the app (their bodies unread); a slot frees when its request ends (a stream: when
it is done); loopback addresses count toward the total only; other paths pass untouched."""

from __future__ import annotations

import asyncio
import http.client
import json
import threading
import time

import pytest

from corolla.api.admission import Admission, is_loopback
from corolla.api.serving import serve_in_thread

PATH = "/v1/completions"


class HeldApp:
    """An app whose requests stay inside until `release` is set; counts the requests it saw."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.entered = 0

    async def __call__(self, scope, receive, send) -> None:
        self.entered += 1
        await self.release.wait()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})


async def _call(admission: Admission, client: str, path: str = PATH) -> tuple[int, dict[bytes, bytes], bytes]:
    scope = {"type": "http", "path": path, "client": (client, 40000), "method": "POST", "headers": []}
    sent: list[dict] = []

    async def receive() -> dict:
        raise AssertionError("a refused request's body is never read")

    async def send(message: dict) -> None:
        sent.append(message)

    await admission(scope, receive, send)
    start = next(m for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return start["status"], dict(start["headers"]), body


def test_past_an_addresss_bound_and_past_the_total_a_request_is_refused_unread():
    async def scenario() -> None:
        app = HeldApp()
        admission = Admission(app, paths=(PATH,), max_in_flight=5, max_per_client=2, retry_after_s=3)
        held = [asyncio.ensure_future(_call(admission, "203.0.113.7")) for _ in range(2)]
        await asyncio.sleep(0)
        status, headers, body = await _call(admission, "203.0.113.7")  # its third: refused at once
        assert status == 429 and headers[b"retry-after"] == b"3"
        assert json.loads(body)["error"]["code"] == "rate_limit_exceeded"
        assert "max_requests_per_client" in json.loads(body)["error"]["message"]
        # another address still gets in, and loopback ones count toward the total only
        held += [asyncio.ensure_future(_call(admission, "198.51.100.1"))]
        held += [asyncio.ensure_future(_call(admission, "127.0.0.1")) for _ in range(2)]
        await asyncio.sleep(0)
        assert app.entered == 5 and admission.in_flight == 5
        status, _, body = await _call(admission, "::1")  # the total is reached: refused whoever asks
        assert status == 429 and "max_queued_requests" in json.loads(body)["error"]["message"]
        app.release.set()
        assert [r[0] for r in await asyncio.gather(*held)] == [200] * 5
        assert admission.in_flight == 0 and admission.per_client == {}
        assert (await _call(admission, "203.0.113.7"))[0] == 200  # slots free once their requests end

    asyncio.run(asyncio.wait_for(scenario(), 10))


def test_other_paths_are_not_counted():
    async def scenario() -> None:
        app = HeldApp()
        app.release.set()
        admission = Admission(app, paths=(PATH,), max_in_flight=1, max_per_client=1, retry_after_s=1)
        admission.in_flight = 1  # full
        assert (await _call(admission, "203.0.113.7", path="/health"))[0] == 200

    asyncio.run(asyncio.wait_for(scenario(), 10))


@pytest.mark.parametrize(
    "host,loopback",
    [("127.0.0.1", True), ("127.3.4.5", True), ("::1", True), ("::ffff:127.0.0.1", True), ("10.0.0.1", False),
     ("::ffff:10.0.0.1", False), ("testclient", False), ("", False)],
)  # fmt: skip
def test_is_loopback(host, loopback):
    assert is_loopback(host) is loopback


class ThreadHeldApp:
    """An ASGI app (lifespan included) whose requests stay inside until `release` is set, served by uvicorn."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.entered = 0

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            while (message := await receive())["type"] != "lifespan.shutdown":
                await send({"type": message["type"] + ".complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        self.entered += 1
        while not self.release.is_set():
            await asyncio.sleep(0.01)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})


def _post(port: int, forwarded_for: str) -> int:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        connection.request("POST", PATH, body=b"{}", headers={"X-Forwarded-For": forwarded_for})
        return connection.getresponse().status
    finally:
        connection.close()


def test_a_loopback_proxys_clients_are_counted_by_their_forwarded_address():
    """A reverse proxy on the gateway's machine connects from 127.0.0.1 (not counted per client) and names each
    client in X-Forwarded-For, which uvicorn trusts from loopback and writes into the request's address before the
    middleware: its clients are bounded one by one (README, contracts)."""
    app = ThreadHeldApp()
    admission = Admission(app, paths=(PATH,), max_in_flight=8, max_per_client=1, retry_after_s=1)
    with serve_in_thread(admission) as running:
        statuses: list[int] = []
        first = threading.Thread(target=lambda: statuses.append(_post(running.port, "203.0.113.7")))
        first.start()
        deadline = time.monotonic() + 30
        while app.entered < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert app.entered == 1
        assert _post(running.port, "203.0.113.7") == 429  # the same forwarded client's second
        app.release.set()
        first.join(30)
        assert statuses == [200]
        assert _post(running.port, "203.0.113.7") == 200  # its slot freed at its first request's end
