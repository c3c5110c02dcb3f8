"""corolla-api bounds request bodies (`max_request_bytes`): a declared Content-Length over the limit gets 413 before
any body byte is read, a chunked body is cut off with 413 as soon as it passes the limit, small requests still work."""

from __future__ import annotations

import json
import socket
import time
import urllib.parse

import pytest
from test_api_app import ScriptedBackend, post_raw

from corolla.api.app import ApiConfig, create_app
from corolla.api.serving import serve_in_thread

LIMIT = 64 * 1024
pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def api():
    with serve_in_thread(create_app(ScriptedBackend(), ApiConfig(max_request_bytes=LIMIT))) as running:
        yield running


def _connect(url: str) -> socket.socket:
    parsed = urllib.parse.urlparse(url)
    return socket.create_connection((parsed.hostname, parsed.port), timeout=10)


def _status(sock: socket.socket) -> tuple[int, bytes]:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), rest


def test_small_request_still_works(api):
    body = json.dumps({"model": "fake/scripted-model", "prompt": "Hi", "max_tokens": 2}).encode()
    status, reply = post_raw(api.url + "/v1/completions", body)
    assert status == 200, reply


def test_declared_length_over_the_limit_is_refused_before_the_body(api):
    with _connect(api.url) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 200000000\r\n\r\n"
        )  # and not one byte of the 200 MB
        status, rest = _status(sock)
    assert status == 413
    assert b"max_request_bytes" in rest or b"limit" in rest


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_streamed_body_is_cut_off_at_the_limit(api, path):
    chunk = b"x" * 4096
    sent = 0
    with _connect(api.url) as sock:
        sock.sendall(
            f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            "Transfer-Encoding: chunked\r\n\r\n".encode()
        )
        sock.settimeout(0.05)
        deadline = time.monotonic() + 20
        status = None
        while time.monotonic() < deadline and sent < 64 * LIMIT:
            try:
                sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                sent += len(chunk)
            except (BrokenPipeError, ConnectionResetError, TimeoutError):
                break
            try:
                if sock.recv(1, socket.MSG_PEEK):
                    break
            except (TimeoutError, BlockingIOError):
                continue
        sock.settimeout(10)
        status, _ = _status(sock)
    assert status == 413
    assert sent < 16 * LIMIT, f"server let {sent} bytes in before refusing"


def test_limit_must_be_positive():
    with pytest.raises(ValueError, match="max_request_bytes"):
        ApiConfig(max_request_bytes=0)
